"""Whether training code sums or squares an instrumented model's float16
outputs before it casts them: the warning that says so, given only where
it is true.

A loss written by hand that reduces float16 outputs over a batch in float16
can overflow 65504 and read a constant, with every gradient 0 and nothing
to skip. Whether a loss does that is visible in the traced step: the ops
that consume the outputs. The model records its float16 outputs in each
graph it is called in (`note`); the optimizer's `apply`, traced into the
same graph after the loss, asks (`warn_if_reduced`), which walks the
consumers of those outputs through float16 ops: a sum, mean, product or
square reached before a cast to a wider float is the case to warn about;
a cast first (Keras's losses cast, and so does a hand-written loss on
`tf.cast(y_pred, "float32")`) is not. Eagerly nothing of the loss is
visible when the model runs: a training call warns there, as it always
did.
"""

import warnings
import weakref

import tensorflow as tf

from tf_als._src.model import _keras

# Ops that reduce or square their float16 input: where a sum over a batch
# can overflow.
_REDUCING = frozenset({
    "Sum", "Mean", "Prod", "Square", "SquaredDifference", "L2Loss", "Pow",
    "Cumsum", "EuclideanNorm",
})
# How many ops the walk visits at most (a loss is a few dozen).
_WALK_LIMIT = 500

_MESSAGE = (
    "Model {model!r} hands its training code float16 outputs ({names}){where}. "
    "A loss written by hand that sums or squares them over a batch can "
    "overflow float16 (65504) and read a constant with every gradient 0, "
    "without a non-finite value to skip. Compute the loss on "
    "`tf.cast(y_pred, 'float32')`, give the output layer dtype='float32', "
    "or pass `float32_outputs=True` to tf_als.instrument (the cast is exact)."
)


class Recorded:
    """The float16 outputs a model handed to training code, per graph
    (an entry lives as long as its graph), and whether it warned."""

    def __init__(self):
        self._graphs = weakref.WeakKeyDictionary()
        self.warned = False

    def note(self, model, names, tensors, training) -> None:
        """`model` returned the float16 `tensors` (named `names`) to code
        other than Keras's own train step: in a traced graph, kept for
        `warn_if_reduced`; eagerly, a warning now when `training`."""
        graph = _traced_graph()
        if graph is not None:
            self._graphs.setdefault(graph, []).append((names, list(tensors)))
        elif training:
            self._warn(model, names, "")

    def warn_if_reduced(self, model) -> None:
        """Warns (once) if training code in the graph being traced sums or
        squares float16 outputs `note` recorded there before a cast."""
        graph = _traced_graph()
        if self.warned or graph is None:
            return
        for names, tensors in self._graphs.get(graph, []):
            if reduced_in_float16(tensors):
                self._warn(model, names, ", which it sums or squares in float16")
                return

    def _warn(self, model, names, where):
        self.warned = True
        warnings.warn(
            _MESSAGE.format(model=model.name, names=", ".join(names), where=where),
            stacklevel=5,
        )


def reduced_in_float16(tensors) -> bool:
    """Whether an op of `_REDUCING` consumes one of the float16 `tensors`,
    or a float16 tensor computed from them by other float16 ops, in their
    graph (gradient ops and tf_als's own measurements aside).

    >>> def traced(loss):
    ...     spec = tf.TensorSpec([4], tf.float16)
    ...     return tf.function(loss).get_concrete_function(spec).graph.inputs[0]
    >>> reduced_in_float16([traced(lambda y: tf.reduce_sum(tf.square(y - 1.0)))])
    True
    >>> reduced_in_float16([traced(lambda y: tf.reduce_sum(tf.cast(y, tf.float32) ** 2))])
    False
    """
    seen, frontier = set(), [t for t in tensors if t.dtype == tf.float16]
    while frontier and len(seen) < _WALK_LIMIT:
        tensor = frontier.pop()
        for op in tensor.consumers():
            if op.name in seen or _not_training_code(op.name):
                continue
            seen.add(op.name)
            if op.type in _REDUCING:
                return True
            frontier.extend(o for o in op.outputs if o.dtype == tf.float16)
    return False


def _traced_graph():
    """The graph being traced, or None when executing eagerly."""
    return None if tf.executing_eagerly() else _keras.default_graph()


def _not_training_code(name: str) -> bool:
    """Ops a tape's gradient or tf_als itself made."""
    return "gradient_tape/" in name or "gradients/" in name or "tf_als_" in name
