"""Switching the layers whose float16 arithmetic fails to float32.

`preflight` finds them, on the first batch before any step is lost
and again where a run would stop or stall (`max_consecutive_skips` skipped
steps in a row, or as many within twice that many steps); this module
promotes them and keeps the record.

A promoted layer gets the `"float32"` dtype policy: its variables are
float32 already, so no state changes; it now computes in float32, with casts
at its boundary as Keras makes for any float32 layer: the one-line fix an
expert applies by hand. Every layer found is promoted at once, so layers of
one class that fail for one reason (three hand-written normalisations)
go together. The cap is on failures, not layers: at most `MAX_FAILURES`
distinct (layer class, kind of reason) pairs per model.

The promoted layers are listed by `promoted(model)`, saved with the model
(`model.save` keeps each layer's dtype policy and the list), and reported
by `tf_als.callbacks.ScaleHistory`.
"""

import dataclasses
import json
from typing import Iterable, Optional

import keras
import tensorflow as tf

from tf_als._src.model import _keras
from tf_als._src.failures import nonfinite

# How many distinct failures (a layer class and a kind of reason) a model
# may promote. Every layer of a failure is promoted, however many: the cap
# protects the healthy layers from a search that keeps finding things.
MAX_FAILURES = 4
FORWARD = "float16 forward output not finite"
STRAYS = "float16 forward output strays from float32's"
TARGETS = "float16 output cannot reach its targets"
LOSS_DEPARTS = "the loss computed from its float16 output differs from float32's"
BACKWARD = "float16 backward pass not finite"
COMPOSITE = (
    "float16 output not finite, from its own code between its sublayers "
    "(each of them is finite on what it received)"
)
REASONS = (FORWARD, STRAYS, TARGETS, LOSS_DEPARTS, BACKWARD, COMPOSITE)


@dataclasses.dataclass(frozen=True)
class Promotion:
    """One layer switched to float32.

    Attributes:
        layer: the layer's path in the model (`layer.path`).
        reason: why, beginning with one of `REASONS`: `FORWARD` (its float16
            output was not finite while float32's was), `STRAYS` (finite,
            but far from float32's), `TARGETS` (a float16 model output
            whose targets float16 cannot hold), `LOSS_DEPARTS` (the training
            loss on this model output overflows in float16: a sum over the
            outputs of a batch) or `BACKWARD` (which part of its backward
            pass was not finite at every loss scale).
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


def failures(model: keras.Model) -> set:
    """The distinct failures promoted so far on `model`: (layer class, kind
    of reason) pairs. Layers of one class that fail for one reason are one
    failure, however many there are."""
    found = set()
    for promotion in model.promotions:
        layer = layer_at(model.uninstrumented(), promotion.layer)
        found.add((type(layer).__name__, kind(promotion.reason)))
    return found


def kind(reason: str) -> str:
    """The kind of a promotion's reason: one of `REASONS`."""
    return next((k for k in REASONS if reason.startswith(k)), reason)


def promote_all(model: keras.Model, findings, step: int, previous=None) -> tuple:
    """Switches the layers of `findings` (`preflight.Finding`s:
    layer path and reason) to float32, all of them, within the cap of
    `MAX_FAILURES` distinct failures. `previous`, a dict, receives each
    promoted layer's former policy name (for `undo`).

    Returns:
        (the new `Promotion`s, in order; why a finding was left
        unpromoted, or None).
    """
    made = []
    for finding in findings:
        layer = layer_at(model.uninstrumented(), finding.layer)
        if layer is None:
            return tuple(made), f"layer {finding.layer!r} is not a layer of the model"
        if layer.compute_dtype == "float32":
            return tuple(made), (
                f"layer {finding.layer!r} computes in float32 already "
                f"({finding.reason}), so promoting it cannot help"
            )
        key = (type(layer).__name__, kind(finding.reason))
        known = failures(model)
        if key not in known and len(known) >= MAX_FAILURES:
            return tuple(made), (
                f"layer {finding.layer!r} would also need float32 "
                f"({finding.reason}), past the cap of {MAX_FAILURES} distinct "
                "failures (a layer class and a reason each; promoted so far: "
                + ", ".join(repr(p.layer) for p in model.promotions)
                + "); a model failing in more ways than that needs a look, "
                "not more float32"
            )
        if previous is not None:
            previous[finding.layer] = [l.dtype_policy.name for l in layers_of(layer)]
        _to_float32(layer)
        promotion = Promotion(layer=finding.layer, reason=finding.reason, step=step)
        model.promotions.append(promotion)
        made.append(promotion)
    _log(model)
    return tuple(made), None


def undo(model: keras.Model, path: str, policies: list) -> None:
    """Takes back the promotion of the layer at `path`, which computes under
    `policies` again, its sublayers too, in the order of `layers_of` (it
    failed in float32 too)."""
    for layer, policy in zip(layers_of(layer_at(model.uninstrumented(), path)), policies):
        _keras.set_dtype_policy(layer, policy)
    model.promotions[:] = [p for p in model.promotions if p.layer != path]
    _log(model)


def restore(model: keras.Model, records: Iterable[dict]) -> None:
    """Re-applies saved promotions (dicts from `Promotion.as_dict`) that
    `model` does not have yet, in order."""
    for record in list(records)[len(model.promotions):]:
        promotion = Promotion(**record)
        layer = layer_at(model.uninstrumented(), promotion.layer)
        if layer is None:
            raise ValueError(
                f"The saved model promoted layer {promotion.layer!r} to "
                "float32, but the loaded model has no layer at that path."
            )
        _to_float32(layer)
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


def layers_of(layer) -> list:
    """What promoting `layer` switches to float32: the layer, and a
    composite's sublayers at every depth, so that its own code and theirs
    compute in float32 end to end, as `dtype="float32"` on a layer intends
    (in Keras 3 a layer's dtype does not reach the sublayers its
    `__init__` makes)."""
    inner = _keras.sublayers(layer, recursive=True)
    return [layer] + [l for l in inner if not isinstance(l, keras.layers.InputLayer)]


def _to_float32(layer) -> None:
    for each in layers_of(layer):
        _keras.set_dtype_policy(each, "float32")


def _log(model):
    model.promotion_log.records = [p.as_dict() for p in model.promotions]


def advice(model: keras.Model, path: str, promoting: bool = True) -> str:
    """The fix by hand for the layer at `path` of `model` (plain), failing
    in float16, as a user applies it in Keras 3; tested by applying it.
    With `promoting`, it adds that tf_als's check does it (say False where
    the user turned `promote_on_storm` off)."""
    layer = layer_at(model, path)
    if layer is None or not _keras.sublayers(layer, recursive=False):
        weights = "its weights are float32 already; " if layer is None or layer.weights else ""
        return (
            f"Give layer {path!r} dtype='float32' where it is built ({weights}"
            "Keras casts its inputs and outputs)"
            + (
                ", or train with tf_als, whose first-batch check does this "
                "for you." if promoting else "."
            )
        )
    direct = _keras.sublayers(layer, recursive=False)
    inner = ", ".join(repr(l.name) for l in direct)
    # Keras's and KerasHub's own composites pass their policy on already.
    nested = [
        l.name for l in direct
        if _keras.sublayers(l, recursive=False)
        and type(l).__module__.split(".")[0] not in ("keras", "keras_hub")
    ]
    deeper = (
        " (and so inside " + ", ".join(repr(n) for n in nested) + ", which "
        + ("has sublayers of its own" if len(nested) == 1 else "have sublayers of their own")
        + ")"
    ) if nested else ""
    return (
        f"Layer {path!r} is made of sublayers ({inner}), and in Keras 3 a "
        "layer's dtype does not reach the sublayers its __init__ makes: "
        "dtype='float32' on it alone leaves them in float16. Make each "
        f"sublayer with dtype=self.dtype_policy in its __init__{deeper} (as "
        f"KerasHub's layers do) and give {path!r} dtype='float32'"
        + (
            "; or train with tf_als, whose first-batch check promotes the "
            "layer with its sublayers." if promoting else "."
        )
    )


def layer_at(model, path) -> Optional[keras.layers.Layer]:
    """The layer of `model` (plain) at `path` (`nonfinite.layer_path`), or
    None."""
    for layer in _keras.all_layers(model):
        if nonfinite.layer_path(layer) == path:
            return layer
    return None
