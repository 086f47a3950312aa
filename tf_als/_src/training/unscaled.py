"""The weight gradients a traced backward pass unscaled, so that the
optimizer can divide them by the global scale S in the same multiply.

Each scaling point hands the tape `raw * factor` for every weight gradient
of its call (`factor` = 1/T_in, in float32), so every variable receives S
times its true gradient. Keras's `LossScaleOptimizer` then divides each
gradient by S: a second elementwise op on every weight gradient, inside
the conditional that applies finite steps. Where a variable's whole
gradient is one such product (one call reads the variable, and nothing
outside the points does, such as a kernel regularizer),
`raw * (factor / S)` gives the divided gradient in one op; for powers of
two it is the very same float32 value. Any other gradient
(a sum over calls, a regularizer's term added in) is divided by S as Keras
divides it.

Products are recognised by object identity within the graph being traced,
so a match is exact by construction; eager steps record nothing (there the
product is already computed, and folding would save no work).
"""

import weakref

import keras
import tensorflow as tf

from tf_als._src.model import _keras


def unscale(gradient, factor):
    """`gradient` times `factor` (a float32 scalar), computed in float32
    and returned in the gradient's dtype; sparse gradients
    (`tf.IndexedSlices`) stay sparse, None stays None.

    >>> unscale(tf.constant([2.0, 4.0], tf.float16), tf.constant(0.5)).numpy()
    array([1., 2.], dtype=float16)
    """
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            unscale(gradient.values, factor), gradient.indices, gradient.dense_shape
        )
    result = tf.cast(gradient, tf.float32) * factor
    return tf.cast(result, gradient.dtype)


class UnscaledGradients:
    """The `unscale(raw, factor)` products of the graphs being traced.

    Example:

    ```python
    unscaled = UnscaledGradients()
    # in the backward pass (inside a `tf.function`):
    gradient = unscaled.unscale(raw, factor)
    # in the optimizer, in the same graph:
    unscaled.divided(gradient, scale)  # unscale(raw, factor / scale)
    ```
    """

    def __init__(self):
        # graph -> {id(product): (product, raw, factor)}; an entry lives as
        # long as the graph it was traced into.
        self._graphs = weakref.WeakKeyDictionary()
        # graph -> {(id(factor), id(scale)): (factor, scale, factor / scale)}:
        # one division per call and step, whatever its variables.
        self._quotients = weakref.WeakKeyDictionary()

    def unscale(self, raw, factor):
        """`unscale(raw, factor)`, recorded when a graph is being traced."""
        product = unscale(raw, factor)
        graph = traced_graph()
        if graph is not None and product is not None:
            self._graphs.setdefault(graph, {})[id(product)] = (product, raw, factor)
        return product

    def divided(self, gradient, scale):
        """`gradient / scale` computed as `unscale(raw, factor / scale)`, one
        op, if `gradient` is a product recorded in the graph being traced;
        None otherwise."""
        graph = traced_graph()
        products = self._graphs.get(graph, {}) if graph is not None else {}
        entry = products.get(id(gradient))
        if entry is None or entry[0] is not gradient:
            return None
        _, raw, factor = entry
        quotients = self._quotients.setdefault(graph, {})
        key = (id(factor), id(scale))
        if key not in quotients:
            quotients[key] = (factor, scale, factor / tf.cast(scale, tf.float32))
        return unscale(raw, quotients[key][2])


def divide_by_scale(optimizer, grads, variables, models, scale) -> list:
    """`grads` divided by `scale`, this step's global scale of `optimizer`
    (read once by its `apply`): a gradient the
    backward pass of one of `models` unscaled as a whole is divided in
    that same multiply (`UnscaledGradients.divided`), any other as Keras
    divides it; a gradient the optimizer overwrites its variable with is
    left as it is."""
    result = []
    with tf.name_scope("tf_als_divide"):
        for g, v in zip(grads, variables):
            if g is None or _keras.overwrites_with_gradient(optimizer, v):
                result.append(g)
                continue
            folded = None
            for model in models:
                folded = model.unscaled_gradients.divided(g, scale)
                if folded is not None:
                    break
            result.append(keras.ops.divide(g, scale) if folded is None else folded)
    return result


def traced_graph():
    """The graph being traced, or None when executing eagerly."""
    if tf.executing_eagerly():
        return None
    return _keras.default_graph()
