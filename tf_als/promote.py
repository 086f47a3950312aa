"""Self-healing float16: when a run's float16 arithmetic fails in one layer,
that layer is switched to float32 and training carries on.

`AdaptiveLossScaleOptimizer(promote_on_storm=True)` calls on this module
where the run would otherwise stop or stall: `max_consecutive_skips` skipped
steps in a row, or as many within twice that many steps.

- When the loss itself was not finite, no loss scale can help: the float16
  forward pass overflowed. `rescue` re-runs training batches eagerly
  (`tf_als.forward`) and blames the first layer whose float16 output is not
  finite while its inputs are.
- When the loss was finite, the backward pass failed. `rescue_backward`
  re-runs training batches eagerly at the global scale the run fell to,
  without per-layer scales (`tf_als.backward_search`), and blames the first
  layer, walking from the loss, whose backward pass turns a finite gradient
  into a non-finite one, or the layer whose float16 output cannot carry the
  loss's gradient (a float16 softmax under a cross-entropy).

The blamed layer gets the `"float32"` dtype policy: its variables are
float32 already, so no state changes; it now computes in float32, with casts
at its boundary as Keras makes for any float32 layer. This repeats on the
same batches until they are finite, within a cap of 10% of the model's
layers with weights; a promotion after which the same layer is blamed again
is undone.

The promoted layers are listed by `promoted(model)`, saved with the model
(`model.save` keeps each layer's dtype policy and the list), and reported
by `tf_als.callbacks.ScaleHistory`.
"""

import dataclasses
import json
import math
from typing import Callable, Iterable, Optional

import keras
import tensorflow as tf

from tf_als import _keras
from tf_als import backward_search
from tf_als import forward

MAX_PROMOTED_FRACTION = 0.1
FORWARD = "float16 forward output not finite"
BACKWARD = "float16 backward pass not finite"


@dataclasses.dataclass(frozen=True)
class Promotion:
    """One layer switched to float32.

    Attributes:
        layer: the layer's path in the model (`layer.path`).
        reason: why: `FORWARD` (its float16 output was not finite while
            its inputs were), or `BACKWARD` and which part of its backward
            pass was not finite while the gradient reaching it was.
        step: the optimizer step (`iterations`) at which it was promoted.
    """

    layer: str
    reason: str
    step: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class PromotionLog(tf.train.experimental.PythonState):
    """A model's promotions (`Promotion.as_dict` records), saved in
    object-based checkpoints as JSON."""

    def __init__(self):
        self.records = []

    def serialize(self):
        return json.dumps(self.records)

    def deserialize(self, string_value):
        self.records = json.loads(string_value)


def promoted(model: keras.Model) -> list:
    """The `Promotion`s made so far on `model` (an instrumented model), in
    order.

    Example:

    ```python
    model.fit(x, y)
    tf_als.promoted(model)
    # [Promotion(layer='logits', reason='float16 forward output not finite', step=40)]
    ```
    """
    sync(model)
    return list(getattr(model, "promotions", ()))


def limit(model: keras.Model) -> int:
    """How many layers `model` may promote: 10% of its layers with weights,
    and at least one."""
    weighted = [
        layer
        for layer in _keras.sublayers(model.model, recursive=True)
        if layer.weights and not _keras.sublayers(layer, recursive=False)
    ]
    return max(1, math.floor(MAX_PROMOTED_FRACTION * len(weighted)))


def rescue(
    model: keras.Model,
    batches: Callable[[], Iterable],
    step: int,
    max_batches: int = 8,
) -> tuple:
    """Promotes the layers whose float16 forward output is not finite on
    the training batches, one at a time, until the forward pass is finite.

    Args:
        model: the instrumented model.
        batches: callable returning an iterable of input batches.
        step: the optimizer step, for the record.
        max_batches: how many batches to re-run at most.

    Returns:
        (the new `Promotion`s, in order; why the rescue stopped short, or
        None when the forward pass is finite again). With no promotion the
        reason says why (nothing found, or the cap).
    """

    def find():
        culprit = forward.search(model.model, batches(), limit=max_batches)
        return None if culprit is None else (culprit, FORWARD)

    return _promote_until_finite(
        model,
        find,
        step,
        nothing_found=(
            "an eager re-run on the training batches found no layer whose "
            "float16 output is not finite while its inputs are (the data "
            "may hold NaN or inf, or the failing batches or dropout draws "
            "differ), so no layer was promoted to float32"
        ),
    )


def rescue_backward(
    model: keras.Model,
    batches: Callable[[], Iterable],
    loss_fn: Callable,
    scale: float,
    step: int,
    max_batches: int = 8,
) -> tuple:
    """Promotes the layers whose float16 backward pass turns a finite
    gradient into a non-finite one, one at a time, until the gradients of
    the training batches are finite at `scale` (`tf_als.backward_search`,
    on the plain layers: no per-layer scales).

    Args:
        model: the instrumented model.
        batches: callable returning an iterable of `(x, y, sample_weight)`.
        loss_fn: `loss_fn(x, y, y_pred, sample_weight)`, the scalar loss.
        scale: the loss scale to re-run at (the global scale the run fell
            to).
        step: the optimizer step, for the record.
        max_batches: how many batches to re-run at most.

    Returns:
        As `rescue`.
    """

    def find():
        finding = backward_search.search(
            model.model, loss_fn, batches(), scale, limit=max_batches
        )
        if finding is None:
            return None
        if finding.layer is None:
            return (None, f"not finite: {finding.what}")
        return (finding.layer, f"{BACKWARD} ({finding.what})")

    return _promote_until_finite(
        model,
        find,
        step,
        nothing_found=(
            f"an eager re-run on the training batches at the global scale "
            f"{scale:g}, without per-layer scales, found every gradient "
            "finite (the skipped steps came from the per-layer scales, or "
            "the failing batches or dropout draws differ), so no layer was "
            "promoted to float32"
        ),
    )


def _promote_until_finite(model, find, step, nothing_found) -> tuple:
    """Promotes what `find()` blames ((layer path or None, reason), or None
    when all is finite) until it blames nothing, or a layer that computes
    in float32 already.

    A promotion after which the same layer is blamed for the same reason
    did not help and is undone. When a promoted layer is blamed for
    something else (a float32 layer handing its float16 neighbour a
    gradient too large for the global scale the run fell to, say), the
    promotion did its work: what remains is the loss scale's to fix.
    """
    made, previous = [], {}
    room = limit(model) - len(promoted(model))
    while True:
        found = find()
        if found is None:
            return (tuple(made), None) if made else ((), nothing_found)
        culprit, reason = found
        if culprit is None:
            return tuple(made), f"no layer is to blame ({reason})"
        layer = _layer_at(model.model, culprit)
        if layer is None:
            return tuple(made), f"layer {culprit!r} is not a layer of the model"
        if layer.compute_dtype == "float32":
            last = made[-1] if made else None
            if last is not None and (last.layer, last.reason) != found:
                return tuple(made), None
            if last is None:
                return (), (
                    f"layer {culprit!r} computes in float32 already "
                    f"({reason}), so promoting it cannot help"
                )
            _undo(model, layer, made.pop(), previous[culprit])
            return tuple(made), (
                f"layer {culprit!r} is not finite in float32 either "
                f"({reason}), so promoting it cannot help"
            )
        if room <= 0:
            return tuple(made), (
                f"layer {culprit!r} would also need float32 ({reason}), past "
                f"the cap of {limit(model)} promoted layers (10% of the "
                "layers with weights)"
            )
        previous[culprit] = layer.dtype_policy.name
        _keras.set_dtype_policy(layer, "float32")
        promotion = Promotion(layer=culprit, reason=reason, step=step)
        model.promotions.append(promotion)
        _log(model)
        made.append(promotion)
        room -= 1


def _undo(model, layer, promotion, policy):
    _keras.set_dtype_policy(layer, policy)
    model.promotions.remove(promotion)
    _log(model)


def restore(model: keras.Model, records: Iterable[dict]) -> None:
    """Re-applies saved promotions (dicts from `Promotion.as_dict`) that
    `model` does not have yet, in order."""
    for record in list(records)[len(model.promotions):]:
        promotion = Promotion(**record)
        layer = _layer_at(model.model, promotion.layer)
        if layer is None:
            raise ValueError(
                f"The saved model promoted layer {promotion.layer!r} to "
                "float32, but the loaded model has no layer at that path."
            )
        _keras.set_dtype_policy(layer, "float32")
        model.promotions.append(promotion)
    _log(model)


def sync(model: keras.Model) -> None:
    """Applies the promotions of `model.promotion_log` that the model does
    not have yet: after `tf.train.Checkpoint.restore`, which restores the
    log but not the layers' dtype policies. `fit` and
    `promoted` call it; a custom loop that restores a checkpoint calls it
    (or `tf_als.promoted(model)`) before tracing its step."""
    log = getattr(model, "promotion_log", None)
    if log is not None and len(log.records) > len(model.promotions):
        restore(model, log.records)


def _log(model):
    model.promotion_log.records = [p.as_dict() for p in model.promotions]


def _layer_at(model, path) -> Optional[keras.layers.Layer]:
    for layer in _keras.all_layers(model):
        if (getattr(layer, "path", None) or layer.name) == path:
            return layer
    return None
