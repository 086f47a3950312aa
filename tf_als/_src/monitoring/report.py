"""`diagnose(model, x, y)`: one batch in float32, in float16 with Keras's
global loss scaling, and in float16 with tf_als, compared layer by layer.

All three runs use the model's own layers and weights: the float32 reference
runs them with every layer's dtype policy switched to float32 for the
duration (the float32 variables are the master weights of mixed precision
anyway), so no copy is built and no `get_config` round trip is needed.
Every run starts from the same random state and draws in float32, so all
of them see the same dropout masks, noise and augmentations.
"""

import math

import keras
import numpy as np

from tf_als._src.model import _keras
from tf_als._src.monitoring import diagnosis
from tf_als._src.monitoring import forward_overflow
from tf_als._src.monitoring import passes
from tf_als._src.model import composite
from tf_als._src.failures import locate
from tf_als._src.failures import preflight
from tf_als._src.failures import promote
from tf_als._src.model import instrumented as instrumented_module
from tf_als._src.model.instrumented import InstrumentedModel
from tf_als._src.training.optimizer import AdaptiveLossScaleOptimizer

FLOAT32_RESOLUTION = 2.0**-23
# Both scalings leave more than this share of a point's weight-gradient
# elements at zero where float32's are not: look for a forward overflow.
MOSTLY_FLUSHED = 0.5


def diagnose(model, x, y, loss=None, *, training=True, verbose=True) -> diagnosis.Diagnosis:
    """Compares float32, Keras's loss scaling and tf_als on one batch.

    Works on any model `tf_als.instrument` accepts, plain or instrumented;
    neither is changed. The float16 runs use the model's layers as they are
    when the model computes in float16, else under `mixed_float16`; the
    float32 reference runs the same layers and weights with every layer's
    dtype policy switched to float32 meanwhile.

    Every run (and every retry at a lower scale) starts from the model's
    variables as found (seed states and moving statistics included) and
    draws its random numbers in float32, so all see the same dropout masks,
    noise and augmentations; on return the model holds those values again.
    A layer that fixes dtype-dependent constants when built keeps them in
    the reference (a float16 `keras.layers.Normalization` holds float16-
    rounded statistics).

    When the loss or the gradients are not finite, the report says where
    (`forward_overflow.message`, or the scaling point whose own backward
    turns them non-finite); a loss not finite in float32 either points at
    the data. When float16 gradients are mostly zero at every scale while
    float32's are not, it tells a forward overflow (a sum past 65504 zeroes
    every gradient with no inf in sight) from underflow: see
    `Diagnosis.forward_overflow`.

    Args:
        model: a built `keras.Model`, or one returned by `tf_als.instrument`.
        x, y: one batch of inputs and targets.
        loss: a Keras loss (name, function or object); defaults to the
            model's compiled loss.
        training: bool, the `training` argument of the forward passes.
        verbose: bool, print the report.

    Returns:
        A `diagnosis.Diagnosis`; `str(diagnosis)` is the printed table.

    Example:

    ```python
    report = tf_als.diagnose(model, x[:64], y[:64],
                             loss="sparse_categorical_crossentropy")
    report.underflowing()                   # ["dense", "dense_1"]
    report.underflowing(scaling="tf_als")   # []
    ```
    """
    source = _source(model)
    loss_fn = _loss_function(model, loss)
    layers = _keras.all_layers(source)
    variables = source.trainable_variables
    with passes.same_randomness(source) as rewind:
        batch = passes.Batch(x, y, loss_fn, training, rewind)
        with _keras.dtype_policy(layers, "float32"):
            reference = passes.gradient_pass(source, variables, batch, compiled=False)
            expected, loss32 = reference()
        mixed = None if _computes_in_float16(layers) else "mixed_float16"
        with _keras.dtype_policy(layers, mixed):
            result = _compare(source, variables, batch, expected, loss32)
    if verbose:
        print(result)
    return result


def _source(model) -> keras.Model:
    """The plain model `diagnose` runs: `model`, or the one it instruments."""
    source = model.uninstrumented() if isinstance(model, InstrumentedModel) else model
    if not isinstance(source, keras.Model):
        raise TypeError(
            f"diagnose() needs a keras.Model; received {type(source).__name__}."
        )
    return source


def _compare(source, variables, batch, expected, loss32):
    """The float16 runs: Keras's loss scaling and tf_als, each traced once
    and re-run at each lower scale until its gradients are finite."""
    keras_gradients = passes.gradient_pass(source, variables, batch)
    (keras_grads, loss16), keras_scale = passes.until_finite(keras_gradients)

    instrumented = instrumented_module.make(source)
    als_gradients = passes.gradient_pass(
        instrumented, instrumented.trainable_variables, batch, _scaling_config()
    )
    (als_grads, _, als_state), als_scale = passes.until_finite(als_gradients)

    failures = _float16_failures(source, batch)
    non_finite = None
    if not np.isfinite(loss32):
        non_finite = (
            "The loss is not finite in float32 either: check the inputs and "
            "labels for NaN or inf (e.g. np.isfinite(x).all()) and whether "
            "the loss can overflow."
        )
    elif failures and (not np.isfinite(loss16) or keras_scale != passes.START_SCALE):
        non_finite = _failing(source, failures)
    elif not np.isfinite(loss16):
        non_finite = forward_overflow.message(source, batch)
    elif keras_scale != passes.START_SCALE:
        # Replay Keras's first step through scaling points held at 1, which
        # record where the gradient stops being finite.
        probe = passes.gradient_pass(
            instrumented, instrumented.trainable_variables, batch,
            _scaling_config(max_layer_scale=1.0),
        )
        probe_grads, _, probe_state = probe(passes.START_SCALE)
        non_finite = _locate_non_finite(instrumented, probe_grads, probe_state)

    present = [g is not None for g in expected]
    rows = tuple(
        _rows(instrumented, als_state, present, expected, keras_grads, als_grads)
    )
    overflow = None
    if non_finite is None and _mostly_flushed(rows):
        overflow = forward_overflow.find(source, batch, loss16, loss32)
    return diagnosis.Diagnosis(
        rows=rows,
        keras_loss_scale=keras_scale,
        als_loss_scale=als_scale,
        non_finite=non_finite,
        no_gradient=tuple(v.path for v, p in zip(variables, present) if not p),
        forward_overflow=overflow,
        float16_failures=tuple((f.layer, f.reason) for f in failures),
        failure_advice=tuple(promote.advice(source, f.layer) for f in failures),
    )


def _float16_failures(source, batch) -> list:
    """The layers the first-batch check would promote on the batch
    (`preflight.failing_layers`): one search for `diagnose` and `fit`."""
    batch.rewind()
    return preflight.failing_layers(
        source,
        (batch.x, batch.y, None),
        preflight.batch_mean_loss(batch.loss_fn),
        passes.START_SCALE,
        batch.training,
    )


def _failing(source, failures) -> str:
    """What to say when the float16 loss or the gradients at Keras's first
    scale are not finite and the first-batch check's search names layers:
    the first failure, its fix, and the rest."""
    first = failures[0]
    rest = ", ".join(repr(f.layer) for f in failures[1:])
    return (
        f"Layer {first.layer!r} fails in float16 ({first.reason}); float32 "
        f"runs the batch cleanly. {promote.advice(source, first.layer)}"
        + (f" Then {rest} fail too, found once it computes in float32." if rest else "")
    )


def _scaling_config(max_layer_scale=2.0**15):
    """The per-layer scaling knobs of a default `AdaptiveLossScaleOptimizer`
    with `max_layer_scale`."""
    return AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.0), max_layer_scale=max_layer_scale
    ).scaling_config


def _loss_function(model, loss):
    if loss is None:
        loss = getattr(model, "loss", None)
        if loss is None:
            raise ValueError(
                "diagnose() needs a loss: pass `loss=` (e.g. "
                "loss='sparse_categorical_crossentropy') or compile the model."
            )
    return keras.losses.get(loss) if isinstance(loss, str) else loss


def _computes_in_float16(layers):
    return any(
        layer.weights and getattr(layer, "compute_dtype", None) == "float16"
        for layer in layers
    )


def _flushed(gradient, reference):
    """Fraction of elements that are zero in `gradient` while `reference`
    (float32) resolves them: above float32's relative precision, 2**-23,
    times the row's largest magnitude. Smaller float32 values are rounding
    residue (attention's key bias, whose true gradient is 0, comes out of
    float32 at 1e-18 next to kernel gradients of 1e-11)."""
    gradient, reference = np.concatenate(gradient), np.concatenate(reference)
    magnitude = np.abs(reference)
    resolved = magnitude > FLOAT32_RESOLUTION * magnitude.max(initial=0.0)
    return float(np.mean((gradient == 0) & resolved))


def _relative_error(gradient, reference):
    gradient, reference = np.concatenate(gradient), np.concatenate(reference)
    norm = np.linalg.norm(reference)
    if not np.all(np.isfinite(gradient)):
        return math.inf
    return float(np.linalg.norm(gradient - reference) / norm) if norm else 0.0


def _rows(instrumented, states, present, expected, keras_grads, als_grads):
    """A row per scaling point with weight gradients of its own: every
    weighted layer, inside opened composites too, `states` holding each
    point's `ScalingPoint.read()` values. Variables without a gradient are
    left out (`diagnosis.Diagnosis.no_gradient` lists them)."""
    index = {id(v): i for i, v in enumerate(instrumented.uninstrumented().trainable_variables)}
    rows = []
    records = instrumented.point_records
    for point, record, state in zip(instrumented.scaling_points, records, states):
        layer = record.layer
        positions = [
            index[id(v)]
            for v in composite.point_weights(layer)
            if id(v) in index and present[index[id(v)]]
        ]
        if not positions:
            continue  # Frozen, unreached, or opened without weights of its own.

        def pick(grads):
            return [np.ravel(grads[i]) for i in positions]

        rows.append(
            diagnosis.LayerReport(
                point=point.point_name,
                layer=layer.name,
                keras_underflow=_flushed(pick(keras_grads), pick(expected)),
                keras_error=_relative_error(pick(keras_grads), pick(expected)),
                als_underflow=_flushed(pick(als_grads), pick(expected)),
                als_error=_relative_error(pick(als_grads), pick(expected)),
                als_scale=state["scale"],
                als_cumulative_scale=state["cumulative_scale"],
            )
        )
    return rows


def _mostly_flushed(rows) -> bool:
    """Whether some point keeps more than `MOSTLY_FLUSHED` of its weight
    gradients at zero (where float32's are not) under both scalings: what
    tf_als's per-layer scales cannot lift is either deep underflow or no
    gradient to lift at all."""
    return any(
        min(r.keras_underflow, r.als_underflow) > MOSTLY_FLUSHED for r in rows
    )


def _are(what: str) -> str:
    """The verb for `what` (`nonfinite.WEIGHTS`, "weight gradients", is
    plural; `nonfinite.INPUTS`, "input gradient", singular)."""
    return "are" if what.endswith("s") else "is"


def _locate_non_finite(probe, grads, states):
    """Names the first scaling point, walking from the loss, whose incoming
    gradient is finite but whose own backward pass produced non-finite
    values (`locate`), from a probe pass of the instrumented model `probe`
    whose `states` (rows of `passes.gradient_pass`) hold each point's
    incoming amax."""
    plan = probe.plan
    index = {id(v): i for i, v in enumerate(probe.uninstrumented().trainable_variables)}
    incoming = {
        point.call: bool(np.isfinite(values["amax"]))
        for values, point in zip(states, plan.points)
    }

    def weights_finite(call_index):
        weights = plan.calls[call_index].operation.trainable_weights
        return passes.finite([grads[index[id(v)]] for v in weights if id(v) in index])

    finding = locate.first_non_finite(plan, weights_finite, incoming)
    if finding is not None:
        return (
            f"Gradients turn non-finite in layer {finding.layer!r} (scaling "
            f"point {finding.point!r}): the gradient reaching it is finite, "
            f"but its {finding.what} {_are(finding.what)} not. Check that "
            "layer's weights and inputs "
            "for very large values; dynamic loss scaling lowers the "
            "global scale until it fits."
        )
    if incoming:
        last = plan.points[-1].name
        return (
            f"Gradients are non-finite before the first scaling point: the "
            f"gradient reaching {last!r} (closest to the loss) already is. "
            "Check the loss, the labels and the model outputs for NaN or inf."
        )
    return None
