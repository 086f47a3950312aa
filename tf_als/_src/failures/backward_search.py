"""Where a float16 backward pass stops being finite: an eager re-run of the
plain model, with one tape, that names the first layer (walking from the
loss) whose backward pass turns a finite gradient into a non-finite one.

Used by the first-batch check (`preflight`) and when training already
fails (promotion on a storm of skipped steps, `promote`): one eager
forward pass per batch tried (`Forward`), and one backward pass per loss
scale tried on it. The re-run leaves the model as it found it:
non-trainable variables (BatchNormalization's moving statistics, dropout
seeds) are put back afterwards.
"""

import contextlib
import math
from typing import Callable, Iterable, Optional

import keras
import tensorflow as tf

from tf_als._src.model import _keras
from tf_als._src.model import plain
from tf_als._src.failures import nonfinite
from tf_als._src.scaling import rule


class NotCalled(ValueError):
    """A `StepLoss` that never called the model it checks."""


class StepLoss:
    """The loss a custom training step differentiates, computed from one
    of its batches as the step computes it: `fn(batch)` calls the
    models itself (the instrumented ones run their plain forward pass,
    `plain.forward_passes`) and returns the unscaled scalar loss.
    `Forward` takes it in place of a `loss_fn`; its batches are the
    step's own, of any structure."""

    def __init__(self, fn: Callable):
        self.fn = fn


class Forward:
    """One eager forward pass of `model` on `batch`, observed layer by
    layer, and with `loss_fn` its loss under a persistent tape, so that the
    gradients at any number of loss scales cost one backward pass each
    (`at`) and no further forward pass. Leaves every variable it touched
    as it found it (`nonfinite.preserved`).

    Args:
        model: a plain (not instrumented) Keras model.
        batch: `(x, y, sample_weight)`; for a `StepLoss`, the step's batch.
        loss_fn: `loss_fn(x, y, y_pred, sample_weight)`, the scalar loss,
            or a `StepLoss`; None runs the forward pass only (`at` is then
            unavailable).
        training: the `training` argument of the forward pass (a
            `StepLoss` passes its own).

    Attributes:
        model: the model.
        batch: the batch.
        calls: `(layer, (args, kwargs), outputs)` of every layer call, in
            completion order (innermost first).
        y_pred: the model's outputs (a `StepLoss`'s: those of every call
            of `model`, in a list).
        loss: the loss, float32 (None without `loss_fn`).
        from_step: whether the loss is a `StepLoss`'s.

    Example:

    ```python
    forward = backward_search.Forward(model, (x, y, None), loss_fn)
    forward.at(2.0**15)  # Finding(layer='dense', what='input gradient', ...)
    forward.at(1.0)      # None: finite
    forward.largest(1.0) # 4096.0: float16's maximum over the amax at 1
    ```
    """

    def __init__(self, model, batch, loss_fn=None, training: bool = True):
        self.model, self.batch = model, batch
        self.calls = []

        def observe(layer, arguments, outputs):
            self.calls.append((layer, arguments, outputs))

        self._tape = tf.GradientTape(persistent=True) if loss_fn else None
        self.loss = None
        with nonfinite.preserved(model.variables) as keep:
            with self._tape or contextlib.nullcontext():
                if isinstance(loss_fn, StepLoss):
                    before = lambda layer: keep(layer.variables)  # noqa: E731
                    with _keras.layer_calls(observe, before), plain.forward_passes():
                        loss = loss_fn.fn(batch)
                    self.y_pred = self._outputs_of_model()
                else:
                    x, y, sample_weight = batch
                    with _keras.layer_calls(observe):
                        self.y_pred = model(x, training=training)
                    loss = None if loss_fn is None else loss_fn(x, y, self.y_pred, sample_weight)
                if loss is not None:
                    self.loss = tf.cast(loss, tf.float32)
        self.from_step = isinstance(loss_fn, StepLoss)
        self._found = {}  # scale -> Finding or None
        self._amax = {}  # scale -> float16 amax of a finite backward pass
        self._gains = {}  # scale -> {id(layer): gain} of a finite one

    @property
    def targets(self):
        """The batch's targets (None for a `StepLoss`'s batch)."""
        return None if self.from_step else self.batch[1]

    @property
    def own_calls(self) -> list:
        """The `calls` of `model` and its layers (a `StepLoss` may call
        other models too: a generator's loss runs the critic)."""
        own = {id(self.model)} | {id(l) for l in _keras.sublayers(self.model, recursive=True)}
        return [call for call in self.calls if id(call[0]) in own]

    def _outputs_of_model(self) -> list:
        """The outputs of every call of `model` a `StepLoss` made."""
        outputs = [out for layer, _, out in self.calls if layer is self.model]
        if not outputs:
            raise NotCalled(
                f"the step's loss does not call model {self.model.name!r} "
                "itself: it must compute the loss the training step "
                "differentiates for the model's weights by calling the "
                "model on the batch (a step that calls the model's layers "
                "or inner models directly runs none of its scaling points: "
                "instrument the model the step calls)"
            )
        return outputs

    def at(self, scale: float) -> Optional[nonfinite.Finding]:
        """Where the gradients of `scale` times the loss turn non-finite
        (see `first_non_finite_gradient`), or None."""
        if scale not in self._found:
            self._found[scale] = self._backward(scale)
        return self._found[scale]

    def largest(self, scale: float) -> Optional[float]:
        """After `at(scale)` found every gradient finite: the largest power
        of two at which the float16 gradients still fit float16: those of
        the layers' inputs and outputs, and the weight gradients of the
        layers that compute in float16 (float16's maximum over their amax
        at `scale`, times `scale`). Any larger scale overflows one of them;
        this one may still overflow inside a layer's own backward pass.
        None when they are all 0."""
        amax = self._amax.get(scale)
        if not amax:
            return None
        return scale * 2.0 ** math.floor(math.log2(rule.FLOAT16_MAX / amax))

    def gains(self) -> dict:
        """`{id(layer): gain}` of the leaf layers that compute in float16
        and have weights, from the largest scale `at` found finite: the
        amax of the layer's weight gradients over the amax of its output
        gradients (the largest over its calls), the ratio a scaling point
        of that layer measures on every step (`update.write_gains`);
        a ratio of two gradients of one pass, so whatever the scale.
        Empty before a finite `at`."""
        finite = [scale for scale, found in self._found.items() if found is None]
        return dict(self._gains[max(finite)]) if finite else {}

    def _float16_weights(self) -> set:
        """The ids of the variables of the leaf layers that compute in
        float16: their gradients are float16 sums before they are cast
        to the variables' float32, so they overflow with the scale."""
        return {
            id(w)
            for layer, _, _ in self.calls
            if layer.compute_dtype == "float16"
            and not _keras.sublayers(layer, recursive=False)
            for w in layer.trainable_weights
        }

    def _backward(self, scale):
        if self._tape is None:
            raise ValueError("Forward(loss_fn=None) has no backward pass")
        if not bool(tf.math.is_finite(self.loss)):
            return nonfinite.Finding(layer=None, what=nonfinite.LOSS_VALUE)
        floats = [
            (nonfinite.floats(arguments), nonfinite.floats(outputs))
            for _, arguments, outputs in self.calls
        ]
        tensors = [t for inputs, outputs in floats for t in inputs + outputs]
        weights = self.model.trainable_weights
        model_outputs = nonfinite.floats(self.y_pred)
        grads = self._tape.gradient(
            self.loss,
            tensors + weights + model_outputs,
            output_gradients=tf.constant(scale, tf.float32),
        )
        finite = {
            id(t): nonfinite.all_finite(g) for t, g in zip(tensors + weights, grads)
        }
        if all(finite.values()):
            halves = self._float16_weights()
            # One amax per distinct tensor (a call's output is the next
            # call's input): their largest, and the layers' gains.
            amaxes = {}
            pairs = (
                [(t, g) for t, g in zip(tensors, grads) if t.dtype == tf.float16]
                + [(w, g) for w, g in zip(weights, grads[len(tensors) :]) if id(w) in halves]
                + [(t, g) for t, g in zip(model_outputs, grads[-len(model_outputs) :])
                   if t.dtype == tf.float16]
            )
            for t, g in pairs:
                if id(t) not in amaxes:
                    amaxes[id(t)] = _amax([g])
            self._amax[scale] = max(amaxes.values(), default=0.0)
            self._gains[scale] = self._gains_of(amaxes, halves)
            return None
        outputs_finite = [
            nonfinite.all_finite(g) for g in grads[len(tensors) + len(weights) :]
        ]
        calls = [(layer, *f) for (layer, _, _), f in zip(self.calls, floats)]
        return _blame(calls, finite, model_outputs, outputs_finite)

    def _gains_of(self, amaxes, halves) -> dict:
        """`gains`' values from the amaxes of one finite pass (by tensor and
        weight id; `halves`: the ids of the float16 leaf layers' weights)."""
        received, produced = {}, {}
        for layer, _, outputs in self.calls:
            weights = [id(w) for w in layer.trainable_weights if id(w) in halves]
            outs = [amaxes.get(id(o), 0.0) for o in nonfinite.floats(outputs)]
            if not weights or not outs:
                continue
            received[id(layer)] = max(received.get(id(layer), 0.0), *outs)
            produced[id(layer)] = max(amaxes.get(w, 0.0) for w in weights)
        return {
            layer: produced[layer] / amax
            for layer, amax in received.items()
            if amax > 0.0
        }


def first_non_finite_gradient(
    model: keras.Model,
    loss_fn: Callable,
    batch: tuple,
    scale: float,
    training: bool = True,
) -> Optional[nonfinite.Finding]:
    """Runs `model` eagerly on one batch and backpropagates `scale` times
    its loss; returns None when every gradient is finite, else where they
    turned non-finite (a `Forward`'s `at`: to try several scales, make one
    `Forward` and call its `at`).

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
    return Forward(model, batch, loss_fn, training).at(scale)


def search(
    model: keras.Model,
    loss_fn: Callable,
    batches: Iterable,
    scale: float,
    limit: int = 8,
    training: bool = True,
) -> Optional[nonfinite.Finding]:
    """`first_non_finite_gradient` on up to `limit` batches of `batches`
    (an iterable of `(x, y, sample_weight)`), stopping at the first whose
    gradients are not finite; None when all are finite."""
    return nonfinite.search(
        lambda batch: first_non_finite_gradient(model, loss_fn, batch, scale, training),
        batches,
        limit,
    )


def _blame(calls, finite, y_pred, outputs_finite) -> nonfinite.Finding:
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
            return nonfinite.Finding(layer=nonfinite.layer_path(layer), what=nonfinite.WEIGHTS)
        if not inputs_ok(inputs):
            return nonfinite.Finding(layer=nonfinite.layer_path(layer), what=nonfinite.INPUTS)
    if blocks:
        block = min(blocks, key=lambda b: len(_keras.sublayers(b, recursive=True)))
        return nonfinite.Finding(layer=nonfinite.layer_path(block), what=nonfinite.INPUTS)
    for tensor, ok in zip(y_pred, outputs_finite):
        if ok:
            continue
        for layer, _, outputs in calls:  # Innermost producer first.
            if any(o is tensor for o in outputs):
                return nonfinite.Finding(
                    layer=nonfinite.layer_path(layer), what=nonfinite.OUTPUT_GRADIENT
                )
    return nonfinite.Finding(layer=None, what=nonfinite.OUTSIDE)


def _amax(grads) -> float:
    """`rule.amax_of` the gradients among `grads` (None entries left out,
    an `IndexedSlices` by its values), as a float; 0.0 when there are
    none."""
    values = [
        g.values if isinstance(g, tf.IndexedSlices) else g
        for g in grads
        if g is not None
    ]
    return float(rule.amax_of(values)) if values else 0.0
