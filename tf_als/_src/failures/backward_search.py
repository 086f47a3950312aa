"""Where a float16 backward pass stops being finite: an eager re-run of the
plain model, with one tape, that names the first layer (walking from the
loss) whose backward pass turns a finite gradient into a non-finite one.

Used when training already fails (promotion on a storm of skipped steps,
`promote`), so its cost, one eager forward and backward pass per
batch tried, is paid only then. The re-run leaves the model as it found it:
non-trainable variables (BatchNormalization's moving statistics, dropout
seeds) are put back afterwards.
"""

from typing import Callable, Iterable, Optional

import keras
import tensorflow as tf

from tf_als._src.model import _keras
from tf_als._src.failures import nonfinite

# The result type and what it names, as `nonfinite` defines them.
Finding = nonfinite.Finding
WEIGHTS = nonfinite.WEIGHTS
INPUTS = nonfinite.INPUTS
OUTPUT = nonfinite.OUTPUT


def first_non_finite_gradient(
    model: keras.Model,
    loss_fn: Callable,
    batch: tuple,
    scale: float,
    training: bool = True,
) -> Optional[Finding]:
    """Runs `model` eagerly on one batch and backpropagates `scale` times
    its loss; returns None when every gradient is finite, else where they
    turned non-finite.

    The layer to blame is the innermost one, walking from the loss, whose
    output gradient is finite while its input or weight gradients are not;
    or, when the gradient is already non-finite at a model output, the
    layer that produced that output.

    Args:
        model: a plain (not instrumented) Keras model.
        loss_fn: `loss_fn(x, y, y_pred, sample_weight)`, the scalar loss.
        batch: `(x, y, sample_weight)`.
        scale: the loss scale (a power of two, e.g. the global scale).
        training: the `training` argument of the forward pass.

    Example:

    ```python
    def loss_fn(x, y, y_pred, sample_weight):
        return keras.losses.sparse_categorical_crossentropy(y, y_pred)
    backward_search.first_non_finite_gradient(
        model, loss_fn, (x, y, None), scale=1.0)
    # Finding(layer='temperature', what='weight gradients', point=None, receivers=())
    ```
    """
    x, y, sample_weight = batch
    calls = []

    def observe(layer, inputs, outputs):
        calls.append((layer, nonfinite.floats(inputs), nonfinite.floats(outputs)))

    with nonfinite.preserved(model.non_trainable_variables):
        with tf.GradientTape() as tape:
            with _keras.layer_calls(observe):
                y_pred = model(x, training=training)
            loss = tf.cast(loss_fn(x, y, y_pred, sample_weight), tf.float32)
            scaled = loss * scale
    if not bool(tf.math.is_finite(loss)):
        return Finding(layer=None, what=nonfinite.LOSS)
    tensors = [t for _, inputs, outputs in calls for t in inputs + outputs]
    weights = model.trainable_weights
    model_outputs = nonfinite.floats(y_pred)
    grads = tape.gradient(scaled, tensors + weights + model_outputs)
    finite = {id(t): nonfinite.all_finite(g) for t, g in zip(tensors + weights, grads)}
    if all(finite.values()):
        return None
    outputs_finite = [
        nonfinite.all_finite(g) for g in grads[len(tensors) + len(weights) :]
    ]
    return _blame(calls, finite, model_outputs, outputs_finite)


def search(
    model: keras.Model,
    loss_fn: Callable,
    batches: Iterable,
    scale: float,
    limit: int = 8,
    training: bool = True,
) -> Optional[Finding]:
    """`first_non_finite_gradient` on up to `limit` batches of `batches`
    (an iterable of `(x, y, sample_weight)`), stopping at the first whose
    gradients are not finite; None when all are finite."""
    return nonfinite.search(
        lambda batch: first_non_finite_gradient(model, loss_fn, batch, scale, training),
        batches,
        limit,
    )


def _blame(calls, finite, y_pred, outputs_finite) -> Finding:
    """The layer to blame: a leaf call (latest first) whose outputs'
    gradients are finite while its inputs' or weights' are not; else the
    innermost such block (by its inputs: its weights are its parts'); else
    the producer of a model output whose gradient is not finite."""

    def outputs_ok(outputs):
        return all(finite[id(t)] for t in outputs)

    def inputs_ok(inputs):
        return all(finite[id(t)] for t in inputs)

    blocks = []
    for layer, inputs, outputs in reversed(calls):
        if not outputs_ok(outputs):
            continue
        if _keras.sublayers(layer, recursive=False):
            if not inputs_ok(inputs):
                blocks.append(layer)
            continue
        weights_ok = all(finite.get(id(w), True) for w in layer.trainable_weights)
        if not weights_ok:
            return Finding(layer=nonfinite.layer_path(layer), what=WEIGHTS)
        if not inputs_ok(inputs):
            return Finding(layer=nonfinite.layer_path(layer), what=INPUTS)
    if blocks:
        block = min(blocks, key=lambda b: len(_keras.sublayers(b, recursive=True)))
        return Finding(layer=nonfinite.layer_path(block), what=INPUTS)
    for tensor, ok in zip(y_pred, outputs_finite):
        if ok:
            continue
        for layer, _, outputs in calls:  # Innermost producer first.
            if any(o is tensor for o in outputs):
                return Finding(layer=nonfinite.layer_path(layer), what=OUTPUT)
    return Finding(layer=None, what=nonfinite.OUTSIDE)
