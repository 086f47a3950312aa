"""`diagnose(model, x, y)`: one batch in float32, in float16 with Keras's
global loss scaling, and in float16 with tf_als, compared layer by layer.

All three runs use the model's own layers and weights: the float32 reference
runs them with every layer's dtype policy switched to float32 for the
duration (the float32 variables are the master weights of mixed precision
anyway), so no copy is built and no `get_config` round trip is needed.
"""

import contextlib
import dataclasses
import math
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from tf_als import _keras
from tf_als import composite
from tf_als import forward
from tf_als import locate
from tf_als import update
from tf_als.instrument import InstrumentedModel
from tf_als.optimizer import AdaptiveLossScaleOptimizer

MAX_HALVINGS = 64
START_SCALE = 2.0**15
FLOAT32_RESOLUTION = 2.0**-23


@dataclasses.dataclass(frozen=True)
class LayerReport:
    """One scaling point's row of a `Diagnosis`.

    Attributes:
        point: the scaling point's name (as `tf_als.scales` reports it).
        layer: the layer's name.
        keras_underflow: fraction of the layer's weight-gradient elements
            that are exactly zero with Keras's loss scaling but nonzero in
            float32 (flushed to zero by underflow). Float32 values below
            2**-23 times the row's largest are float32's own rounding
            residue and do not count.
        keras_error: relative error |g - g32| / |g32| of those gradients.
        als_underflow, als_error: the same with tf_als.
        als_scale: the per-layer scale tf_als picked on this batch.
        als_cumulative_scale: T_in, the scale the layer's gradients carry.
    """

    point: str
    layer: str
    keras_underflow: float
    keras_error: float
    als_underflow: float
    als_error: float
    als_scale: float
    als_cumulative_scale: float


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """The report `diagnose` returns (and prints).

    Attributes:
        rows: one `LayerReport` per scaling point with trainable weights of
            its own (the weighted layers inside opened composites each
            have theirs), in the order of `tf_als.points`.
        keras_loss_scale: the global scale at which Keras's loss scaling gave
            finite gradients (it starts at 2**15 and halves, as in
            training), or None if no scale did.
        als_loss_scale: the same for tf_als.
        non_finite: what was not finite and where, when the loss or the
            gradients at the starting scale were not finite; else None.
        no_gradient: paths of the trainable variables the loss does not
            reach (no gradient in float32 either).
    """

    rows: tuple
    keras_loss_scale: Optional[float]
    als_loss_scale: Optional[float]
    non_finite: Optional[str]
    no_gradient: tuple = ()

    def underflowing(self, threshold: float = 0.01, scaling: str = "keras") -> list:
        """Points where a scaling flushes more than `threshold` of the
        weight-gradient elements that are nonzero in float32.

        Args:
            threshold: float in [0, 1).
            scaling: `"keras"` (Keras's global loss scale) or `"tf_als"`.
        """
        if scaling not in ("keras", "tf_als"):
            raise ValueError(
                f'`scaling` must be "keras" or "tf_als"; received {scaling!r}.'
            )
        field = "keras_underflow" if scaling == "keras" else "als_underflow"
        return [r.point for r in self.rows if getattr(r, field) > threshold]

    def __str__(self):
        width = max([len("scaling point")] + [len(r.point) for r in self.rows])
        header = (
            f"{'scaling point':<{width}} {'keras underflow':>15} {'keras error':>11}"
            f" {'tf_als underflow':>16} {'tf_als error':>12} {'tf_als scale':>12}"
        )
        lines = [
            "tf_als precision report: weight gradients vs float32, one batch",
            f"global loss scale: keras {_describe_scale(self.keras_loss_scale)}, "
            f"tf_als {_describe_scale(self.als_loss_scale)}",
            header,
            "-" * len(header),
        ]
        for r in self.rows:
            lines.append(
                f"{r.point:<{width}} {r.keras_underflow:>15.2%} "
                f"{r.keras_error:>11.2e} {r.als_underflow:>16.2%} "
                f"{r.als_error:>12.2e} {r.als_scale:>12g}"
            )
        if self.no_gradient:
            lines.append(
                "no gradient (the loss does not reach these variables): "
                + ", ".join(self.no_gradient)
            )
        if self.non_finite:
            lines.append(self.non_finite)
        return "\n".join(lines)


def _describe_scale(scale):
    if scale is None:
        return f"none (not finite at any scale down to 2**{15 - MAX_HALVINGS})"
    return f"{scale:g}"


def diagnose(model, x, y, loss=None, *, training=True, verbose=True) -> Diagnosis:
    """Compares float32, Keras's loss scaling and tf_als on one batch.

    Works on any model `tf_als.instrument` accepts, plain or instrumented;
    neither is changed. The float16 runs use the model's layers as they are
    when the model computes in float16, else under `mixed_float16`; the
    float32 reference runs the same layers and weights with every layer's
    dtype policy switched to float32 meanwhile.

    A layer that fixes dtype-dependent constants when it is built keeps
    them in the reference: `keras.layers.Normalization` holds its mean and
    variance in its compute dtype, so a float16 build compares against a
    reference normalised with float16-rounded statistics.

    When the loss or the gradients are not finite, the report says which:
    a float16 forward pass that overflows is re-run eagerly to name the
    first layer whose output is not finite (while its inputs are); a loss
    that is not finite in float32 either points at the data.

    Args:
        model: a built `keras.Model`, or one returned by `tf_als.instrument`.
        x, y: one batch of inputs and targets.
        loss: a Keras loss (name, function or object); defaults to the
            model's compiled loss.
        training: bool, the `training` argument of the forward passes.
        verbose: bool, print the report.

    Returns:
        A `Diagnosis`; `str(diagnosis)` is the printed table.

    Example:

    ```python
    report = tf_als.diagnose(model, x[:64], y[:64],
                             loss="sparse_categorical_crossentropy")
    report.underflowing()                   # ["dense", "dense_1"]
    report.underflowing(scaling="tf_als")   # []
    ```
    """
    source = model.model if isinstance(model, InstrumentedModel) else model
    loss_fn = _loss_function(model, loss)
    if not isinstance(source, keras.Model):
        raise TypeError(
            f"diagnose() needs a keras.Model; received {type(source).__name__}."
        )
    layers = _keras.all_layers(source)
    variables = source.trainable_variables
    with _keras.dtype_policy(layers, "float32"):
        expected, loss32 = _gradients(source, variables, x, y, loss_fn, training)
    mixed = None if _computes_in_float16(layers) else "mixed_float16"
    with _keras.dtype_policy(layers, mixed):
        return _compare(
            source, variables, x, y, loss_fn, training, expected, loss32, verbose
        )


def _compare(source, variables, x, y, loss_fn, training, expected, loss32, verbose):
    def keras_gradients(scale):
        return _gradients(source, variables, x, y, loss_fn, training, scale)

    (keras_grads, loss16), keras_scale = _until_finite(keras_gradients)

    def als_gradients(scale, max_layer_scale=2.0**15):
        instrumented = InstrumentedModel(source)
        optimizer = AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(0.0),
            initial_scale=scale,
            max_layer_scale=max_layer_scale,
        )
        grads, value = _gradients(
            instrumented, instrumented.trainable_variables, x, y, loss_fn,
            training, scale, optimizer,
        )
        return grads, value, instrumented

    (als_grads, _, instrumented), als_scale = _until_finite(als_gradients)

    non_finite = None
    if not np.isfinite(loss32):
        non_finite = (
            "The loss is not finite in float32 either: check the inputs and "
            "labels for NaN or inf (e.g. np.isfinite(x).all()) and whether "
            "the loss can overflow."
        )
    elif not np.isfinite(loss16):
        non_finite = _forward_message(source, x, training)
    elif keras_scale != START_SCALE:
        # Replay Keras's first step through scaling points held at 1, which
        # record where the gradient stops being finite.
        probe_grads, _, probe = als_gradients(START_SCALE, max_layer_scale=1.0)
        non_finite = _locate_non_finite(probe, probe_grads)

    present = [g is not None for g in expected]
    diagnosis = Diagnosis(
        rows=tuple(_rows(instrumented, present, expected, keras_grads, als_grads)),
        keras_loss_scale=keras_scale,
        als_loss_scale=als_scale,
        non_finite=non_finite,
        no_gradient=tuple(v.path for v, p in zip(variables, present) if not p),
    )
    if verbose:
        print(diagnosis)
    return diagnosis


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


def _gradients(model, variables, x, y, loss_fn, training, scale=1.0, optimizer=None):
    """(the scaled gradients of one batch divided by `scale`, the loss),
    with `optimizer`'s per-layer scales, which the points choose from the
    very gradients they scale (the pass's choices and statistics are
    written into the model's state, as `apply` would write them);
    computed in a `tf.function` as `fit` computes them (on some CPUs
    TensorFlow's graph kernels round float16 differently from its eager
    ones). A variable the loss does not reach has None."""
    if optimizer is not None:
        model.scaling_config = optimizer.scaling_config

    @tf.function
    def compute(x, y):
        with tf.GradientTape() as tape:
            # A loss given by name is Keras's per-sample function: reduce
            # it as compile() would (a Loss object's scalar is kept as is).
            value = tf.reduce_mean(
                tf.cast(loss_fn(y, model(x, training=training)), tf.float32)
            )
            if optimizer is not None:
                scaled = optimizer.scale_loss(value)
            else:
                scaled = value * scale
        grads = tape.gradient(scaled, variables)
        if optimizer is not None:
            update.write_pass(
                model, tf.constant(0, tf.int64), tf.constant(True),
                tf.constant(True), optimizer.scaling_config,
            )
        return [None if g is None else tf.convert_to_tensor(g) for g in grads], value

    with _quiet_retracing():
        grads, value = compute(x, y)
    grads = [None if g is None else np.asarray(g, np.float64) / scale for g in grads]
    return grads, float(value)


@contextlib.contextmanager
def _quiet_retracing():
    """Silences TensorFlow's warning about frequent retracing: every
    `diagnose` call traces functions of its own, once each, and a loop over
    batches would otherwise warn from the fifth call on."""
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        yield
    finally:
        logger.setLevel(level)


def _finite(grads):
    return all(g is None or np.all(np.isfinite(g)) for g in grads)


def _until_finite(compute):
    """(result, scale): halves the scale from 2**15 until the gradients are
    finite, as dynamic loss scaling would over the next steps; the scale is
    None when none of `MAX_HALVINGS` halvings gave finite gradients."""
    scale = START_SCALE
    for _ in range(MAX_HALVINGS + 1):
        result = compute(scale)
        if _finite(result[0]):
            return result, scale
        if isinstance(result[1], float) and not np.isfinite(result[1]):
            break  # The loss itself: no scale helps.
        scale /= 2.0
    return result, None


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


def _rows(instrumented, present, expected, keras_grads, als_grads):
    """A row per scaling point with weight gradients of its own: every
    weighted layer, inside opened composites too. Variables without a
    gradient are left out (`Diagnosis.no_gradient` lists them)."""
    index = {id(v): i for i, v in enumerate(instrumented.model.trainable_variables)}
    rows = []
    for point, layer in zip(instrumented.scaling_points, instrumented.point_layers):
        positions = [
            index[id(v)]
            for v in composite.point_weights(layer)
            if id(v) in index and present[index[id(v)]]
        ]
        if not positions:
            continue  # Frozen, unreached, or opened without weights of its own.

        def pick(grads):
            return [np.ravel(grads[i]) for i in positions]

        state = point.read()
        rows.append(
            LayerReport(
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


def _forward_message(model, x, training):
    """What to say when the float16 loss is not finite but the float32 one
    is: the first layer whose float16 output is not finite."""
    culprit = forward.first_non_finite_output(model, x, training)
    if culprit is None:
        return (
            "The loss is not finite in float16 (it is in float32), though "
            "every layer output is: the loss itself overflows float16; "
            "compute it in float32 (a float32 last layer, as Keras's mixed "
            "precision guide recommends)."
        )
    return (
        f"The float16 forward pass is not finite (float32 is): layer "
        f"{culprit!r} is the first whose output is not finite while its "
        "inputs are. Give that layer dtype='float32' (its computation then "
        "runs in float32, its weights are float32 already), or check its "
        "weights and inputs for very large values."
    )


def _locate_non_finite(probe, grads):
    """Names the first scaling point, walking from the loss, whose incoming
    gradient is finite but whose own backward pass produced non-finite
    values (`tf_als.locate`), from a probe pass that recorded each point's
    incoming amax."""
    plan = probe.plan
    index = {id(v): i for i, v in enumerate(probe.model.trainable_variables)}
    incoming = {
        call_index: bool(np.isfinite(point.read()["amax"]))
        for point, call_index in zip(probe.scaling_points, plan.point_calls)
    }

    def weights_finite(call_index):
        weights = plan.calls[call_index].operation.trainable_weights
        return _finite([grads[index[id(v)]] for v in weights if id(v) in index])

    culprit = locate.first_non_finite(plan, weights_finite, incoming)
    if culprit is not None:
        return (
            f"Gradients turn non-finite in layer {culprit.layer!r} (scaling "
            f"point {culprit.point!r}): the gradient reaching it is finite, "
            f"its {culprit.what} is not. Check that layer's weights and inputs "
            "for very large values; dynamic loss scaling lowers the "
            "global scale until it fits."
        )
    if incoming:
        last = plan.point_names[-1]
        return (
            f"Gradients are non-finite before the first scaling point: the "
            f"gradient reaching {last!r} (closest to the loss) already is. "
            "Check the loss, the labels and the model outputs for NaN or inf."
        )
    return None
