"""Self-healing float16: when a run's float16 forward pass overflows, the
layer where it overflows is switched to float32 and training carries on.

A storm (`max_consecutive_skips` skipped steps in a row) whose first skipped
step had a non-finite loss cannot be cured by any loss scale: the forward
pass itself overflowed float16. `rescue` re-runs the failing training batches
eagerly (`tf_als.forward`), finds the first layer whose float16 output is not
finite while its inputs are, and gives it the `"float32"` dtype policy: its
variables are float32 already, so no state changes; it now computes in
float32, with casts at its boundary as Keras makes for any float32 layer. It
repeats on the same batches until the forward pass is finite, within a cap
of 10% of the model's layers with weights.

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
from tf_als import forward

MAX_PROMOTED_FRACTION = 0.1
FORWARD = "float16 forward output not finite"


@dataclasses.dataclass(frozen=True)
class Promotion:
    """One layer switched to float32.

    Attributes:
        layer: the layer's path in the model (`layer.path`).
        reason: why (`FORWARD`: its float16 output was not finite while
            its inputs were).
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
    made = []
    room = limit(model) - len(promoted(model))
    while True:
        culprit = forward.search(model.model, batches(), limit=max_batches)
        if culprit is None:
            if made:
                return tuple(made), None
            return (), (
                "an eager re-run on the training batches found no layer whose "
                "float16 output is not finite while its inputs are (the data "
                "may hold NaN or inf, or the failing batches or dropout draws "
                "differ), so no layer was promoted to float32"
            )
        layer = _layer_at(model.model, culprit)
        if layer is None:
            return tuple(made), f"layer {culprit!r} is not a layer of the model"
        if layer.compute_dtype == "float32":
            return tuple(made), (
                f"layer {culprit!r} overflows even in float32, so promoting "
                "it cannot help"
            )
        if room <= 0:
            return tuple(made), (
                f"layer {culprit!r} would also need float32, past the cap "
                f"of {limit(model)} promoted layers (10% of the layers with "
                "weights)"
            )
        _keras.set_dtype_policy(layer, "float32")
        promotion = Promotion(layer=culprit, reason=FORWARD, step=step)
        model.promotions.append(promotion)
        _log(model)
        made.append(promotion)
        room -= 1


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
