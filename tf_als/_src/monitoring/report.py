"""`diagnose(model, x, y)`: one batch in float32, in float16 with Keras's
global loss scaling, and in float16 with tf_als, compared layer by layer.

All three runs use the model's own layers and weights: the float32 reference
runs them with every layer's dtype policy switched to float32 for the
duration (the float32 variables are the master weights of mixed precision
anyway), so no copy is built and no `get_config` round trip is needed.
Every run starts from the same random state and draws in float32, so all
of them see the same dropout masks, noise and augmentations.
"""

import contextlib
import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional

import keras
import numpy as np
import tensorflow as tf

from tf_als._src.model import _keras
from tf_als._src.model import composite
from tf_als._src.failures import forward_search
from tf_als._src.failures import locate
from tf_als._src.failures import nonfinite
from tf_als._src.scaling import rule
from tf_als._src.model import instrumented as instrumented_module
from tf_als._src.model.instrumented import InstrumentedModel
from tf_als._src.training.optimizer import AdaptiveLossScaleOptimizer

MAX_HALVINGS = 64
START_SCALE = 2.0**15
FLOAT32_RESOLUTION = 2.0**-23
# A float16 output at least this large (65504 / 16 = 4094, within a factor
# 2**4 of float16's maximum, the threshold of tf_als's forward headroom
# telemetry and warnings) counts as overflowing: growth by that factor, or
# a float16 sum over that many of its elements, reaches inf.
NEAR_MAX = rule.NEAR_MAX_THRESHOLD
# Both scalings leave more than this share of a point's weight-gradient
# elements at zero where float32's are not: look for a forward overflow.
MOSTLY_FLUSHED = 0.5
# A float16 loss or layer output this far from float32's (relative norm)
# is not rounding: float16 rounds each operation to 2**-11, and a forward
# pass compounds that to ~1e-3 (0.1% on GPT-2 tiny); 2**-4 is 6%.
DEPARTURE = 2.0**-4
LOSS = "loss"  # `Diagnosis.forward_overflow` when the loss itself overflows.


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
        forward_overflow: set when both scalings leave more than half of
            some point's weight gradients at zero where float32's are not,
            and the cause is an overflow in the float16 forward pass, not
            underflow (no loss scale brings those gradients back). It is
            the path of the first layer whose float16 output is inf or off
            from float32's by more than 2**-4 (relative norm) while its
            inputs are not (a sum or square inside it overflowed); else of
            the first whose float16 output is inf or within a factor 2**4
            of 65504 (at least 4094) while its float32 output is finite;
            else `"loss"` when every layer agrees but the float16 loss is
            off from float32's by more than 2**-4, as a loss that sums
            float16 outputs is. None otherwise.
            `overflow_advice()` says what to do.
    """

    rows: tuple
    keras_loss_scale: Optional[float]
    als_loss_scale: Optional[float]
    non_finite: Optional[str]
    no_gradient: tuple = ()
    forward_overflow: Optional[str] = None

    def underflowing(self, threshold: float = 0.01, scaling: str = "keras") -> list:
        """Points where a scaling flushes more than `threshold` of the
        weight-gradient elements that are nonzero in float32.

        Zeros that an overflow in the forward pass causes count too: check
        `forward_overflow` first.

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

    def overflow_advice(self) -> Optional[str]:
        """What `forward_overflow` means and the fix, or None when it is None.

        Example:

        >>> report = Diagnosis((), 1.0, 1.0, None, forward_overflow="loss")
        >>> report.overflow_advice()[:36]
        'Not underflow: overflow in the loss.'
        """
        if self.forward_overflow is None:
            return None
        zeros = (
            "Float16 gradients are zero where float32's are not because the "
            "float16 forward pass overflows, and no loss scale brings them back"
        )
        if self.forward_overflow == LOSS:
            return (
                f"Not underflow: overflow in the loss. {zeros}: every layer "
                "output agrees with float32's, the float16 loss does not (a "
                "sum over float16 outputs that passes 65504 does this). "
                "Compute the loss in float32: cast the predictions first, "
                'y_pred = tf.cast(y_pred, "float32").'
            )
        return (
            f"Not underflow: overflow in the forward pass. {zeros}: layer "
            f"{self.forward_overflow!r} is the first whose float16 output is "
            "inf or off from float32's by more than 2**-4 while its inputs "
            "are not (else, within a factor 16 of 65504). Give that layer "
            "dtype='float32' (its weights are float32 already), and the layers "
            "after it until the values are back within float16's range."
        )

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
        if self.forward_overflow is not None:
            lines.append(self.overflow_advice())
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

    Every run (and every retry at a lower scale) starts from the model's
    non-trainable variables as found, seed states and moving statistics
    included, and draws its random numbers in float32, so dropout masks,
    noise and random augmentations are the same in all of them; on return
    the model holds those values again.

    A layer that fixes dtype-dependent constants when it is built keeps
    them in the reference: `keras.layers.Normalization` holds its mean and
    variance in its compute dtype, so a float16 build compares against a
    reference normalised with float16-rounded statistics.

    When the loss or the gradients are not finite, the report says which:
    a float16 forward pass that overflows is re-run eagerly to name the
    first layer whose output is not finite (while its inputs are); a loss
    that is not finite in float32 either points at the data. When float16
    gradients are mostly zero at every scale while float32's are not, it
    tells an overflow in the forward pass or the loss (a sum that passes
    65504 and zeroes every gradient, with no inf in sight) from underflow:
    see `Diagnosis.forward_overflow`.

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
    source = model.uninstrumented() if isinstance(model, InstrumentedModel) else model
    loss_fn = _loss_function(model, loss)
    if not isinstance(source, keras.Model):
        raise TypeError(
            f"diagnose() needs a keras.Model; received {type(source).__name__}."
        )
    layers = _keras.all_layers(source)
    variables = source.trainable_variables
    with _same_randomness(source) as rewind:
        batch = _Batch(x, y, loss_fn, training, rewind)
        with _keras.dtype_policy(layers, "float32"):
            reference = _gradient_pass(source, variables, batch, compiled=False)
            expected, loss32 = reference()
        mixed = None if _computes_in_float16(layers) else "mixed_float16"
        with _keras.dtype_policy(layers, mixed):
            diagnosis = _compare(source, variables, batch, expected, loss32)
    if verbose:
        print(diagnosis)
    return diagnosis


class _Batch(NamedTuple):
    """One batch and how to run it; `rewind()` goes first in every run."""

    x: Any
    y: Any
    loss_fn: Callable
    training: bool
    rewind: Callable[[], None]


@contextlib.contextmanager
def _same_randomness(model):
    """Yields `rewind()`, which puts `model`'s variables (the `SeedGenerator`
    states of its dropout, noise and augmentation layers, moving
    statistics, weights a layer assigns in its own `call`) and Keras's
    global seed state back to their values on entry. Within the block random draws are made in float32
    (`_keras.float32_random_draws`): with the same seed state a float16
    dropout keeps other units than a float32 one, and GPT-2's worst
    gradient error read ~100% from the masks alone. On exit the variables
    hold their entry values."""
    with _keras.global_seed_state() as global_seed, _keras.float32_random_draws():
        variables = list(model.variables) + [global_seed]
        saved = [(v, keras.ops.copy(v.value)) for v in variables]

        def rewind():
            for variable, value in saved:
                variable.assign(value)

        try:
            yield rewind
        finally:
            rewind()


def _compare(source, variables, batch, expected, loss32):
    """The float16 runs: Keras's loss scaling and tf_als, each traced once
    and re-run at each lower scale until its gradients are finite."""
    keras_gradients = _gradient_pass(source, variables, batch)
    (keras_grads, loss16), keras_scale = _until_finite(keras_gradients)

    instrumented = instrumented_module.make(source)
    als_gradients = _gradient_pass(
        instrumented, instrumented.trainable_variables, batch, _scaling_config()
    )
    (als_grads, _, als_state), als_scale = _until_finite(als_gradients)

    non_finite = None
    if not np.isfinite(loss32):
        non_finite = (
            "The loss is not finite in float32 either: check the inputs and "
            "labels for NaN or inf (e.g. np.isfinite(x).all()) and whether "
            "the loss can overflow."
        )
    elif not np.isfinite(loss16):
        non_finite = _forward_message(source, batch)
    elif keras_scale != START_SCALE:
        # Replay Keras's first step through scaling points held at 1, which
        # record where the gradient stops being finite.
        probe = _gradient_pass(
            instrumented, instrumented.trainable_variables, batch,
            _scaling_config(max_layer_scale=1.0),
        )
        probe_grads, _, probe_state = probe(START_SCALE)
        non_finite = _locate_non_finite(instrumented, probe_grads, probe_state)

    present = [g is not None for g in expected]
    rows = tuple(
        _rows(instrumented, als_state, present, expected, keras_grads, als_grads)
    )
    overflow = None
    if non_finite is None and _mostly_flushed(rows):
        overflow = _forward_overflow(source, batch, loss16, loss32)
    return Diagnosis(
        rows=rows,
        keras_loss_scale=keras_scale,
        als_loss_scale=als_scale,
        non_finite=non_finite,
        no_gradient=tuple(v.path for v, p in zip(variables, present) if not p),
        forward_overflow=overflow,
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


def _gradient_pass(model, variables, batch, config=None, *, compiled=True):
    """`run(scale)`: `(the scaled gradients of one batch divided by scale,
    the loss)` from the random state `batch.rewind()` restores. A
    variable the loss does not reach has None.

    With `compiled` (the float16 passes) they are computed in a
    `tf.function` as `fit` computes them: on CPUs with native float16
    (AVX512-FP16) the graph rounds float16 differently from eager
    execution, through Grappler's remapper (its fused kernels). On the
    16-layer sigmoid MLP of test_underflow, eager float16 gradients, and
    a graph's with `remapping` or all of Grappler off, are the same bit
    for bit and differ from `fit`'s: one layer reads 23.6% underflow
    where `fit` flushes 22.4%. So neither eager execution nor skipping the
    graph optimisations is open to the float16 passes. The function is
    traced once: the scale is an argument, so a retry at a lower scale
    re-runs the graph without tracing it again.

    Without `compiled` (the float32 reference) the pass runs eagerly:
    tracing costs most of a pass (3.4 s of CPU against 0.7 s eagerly on
    MobileNetV3Small at 32x32), and float32's eager gradients there are
    within 5e-8 (relative norm) of the graph's, zero for zero, far below
    any float16 error the report shows.

    With `config` (a `ScalingConfig`), `model` is instrumented and its
    points choose their scales with those knobs from the very gradients
    they scale; `run` then also returns each point's row as
    `ScalingPoint.read()` would give it after `apply` wrote the pass
    (`_point_rows`). Nothing is written into the model's state, so every
    run starts from the state the model was made with."""
    loss_fn, training = batch.loss_fn, batch.training
    points = []  # The points the pass reached, in the order of `chosen`.

    def compute(x, y, scale):
        if config is not None:
            model.scaling_config = config  # The knobs the points trace with.
        with tf.GradientTape() as tape:
            # A loss given by name is Keras's per-sample function: reduce
            # it as compile() would (a Loss object's scalar is kept as is).
            value = tf.reduce_mean(
                tf.cast(loss_fn(y, model(x, training=training)), tf.float32)
            )
            # Keras's scale_loss (and an unbuilt AdaptiveLossScaleOptimizer's)
            # multiplies by S in float32, as here.
            scaled = value * scale
        grads = tape.gradient(scaled, variables)
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        if config is None:
            return grads, value
        records = model.pass_record.latest()
        points[:] = sorted(records)
        chosen = _stacked([records[p].scale for p in points])
        scale_out = _stacked([records[p].scale_out for p in points])
        amax = _stacked([records[p].amax for p in points])
        return grads, value, (chosen, chosen * scale_out, amax)

    if compiled:
        compute = tf.function(compute)

    def run(scale=1.0):
        batch.rewind()
        with _quiet_retracing():
            result = compute(batch.x, batch.y, tf.constant(scale, tf.float32))
        grads = [
            None if g is None else np.asarray(g, np.float64) / scale
            for g in result[0]
        ]
        if config is None:
            return grads, float(result[1])
        return grads, float(result[1]), _point_rows(model, points, *result[2])

    return run


def _stacked(values):
    """float32 [len(values)] (empty when there are none)."""
    if not values:
        return tf.zeros([0], tf.float32)
    return tf.stack([tf.cast(v, tf.float32) for v in values])


def _point_rows(model, points, chosen, scale_in, amax) -> list:
    """Every point's `ScalingPoint.read()` values, as `update.write_pass`
    would leave them after a pass that reached `points` with these
    `chosen` scales, `scale_in` (T_in) and incoming `amax`es: those
    fields of the reached points from the pass, everything else as the
    model's state holds it (one read). Diagnose needs only these three
    fields, so the pass computes no telemetry (a tally of every point's
    gradient, most of the instrumented pass's graph)."""
    rows = [values for values, _ in model.scaling_state.read()]
    columns = [np.asarray(c) for c in (chosen, scale_in, amax)]
    for i, point in enumerate(points):
        rows[point] = dict(
            rows[point],
            scale=float(columns[0][i]),
            cumulative_scale=float(columns[1][i]),
            amax=float(columns[2][i]),
        )
    return rows


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


def _rows(instrumented, states, present, expected, keras_grads, als_grads):
    """A row per scaling point with weight gradients of its own: every
    weighted layer, inside opened composites too, `states` holding each
    point's `ScalingPoint.read()` values. Variables without a gradient are
    left out (`Diagnosis.no_gradient` lists them)."""
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


def _forward_message(model, batch):
    """What to say when the float16 loss is not finite but the float32 one
    is: the first layer whose float16 output is not finite."""
    batch.rewind()
    culprit = forward_search.first_non_finite_output(model, batch.x, batch.training)
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


def _mostly_flushed(rows) -> bool:
    """Whether some point keeps more than `MOSTLY_FLUSHED` of its weight
    gradients at zero (where float32's are not) under both scalings: what
    tf_als's per-layer scales cannot lift is either deep underflow or no
    gradient to lift at all."""
    return any(
        min(r.keras_underflow, r.als_underflow) > MOSTLY_FLUSHED for r in rows
    )


def _forward_overflow(model, batch, loss16, loss32) -> Optional[str]:
    """`Diagnosis.forward_overflow`: the layer where the float16 forward pass
    departs from float32's (`_first_departing_layer`), else `LOSS` when only
    the loss does (by more than `DEPARTURE`, relative), else None."""
    culprit = _first_departing_layer(model, batch)
    if culprit is not None:
        return culprit
    if abs(loss16 - loss32) > DEPARTURE * max(abs(loss16), abs(loss32)):
        return LOSS
    return None


class _Call(NamedTuple):
    """One layer call of an eager forward pass: its float inputs and
    outputs (as float32 arrays) and the largest magnitude of its float16
    outputs (inf if one is not finite; 0 without float16 outputs)."""

    layer: Any
    inputs: list
    outputs: list
    amax16: float


def _first_departing_layer(model, batch) -> Optional[str]:
    """The path of the first layer call (innermost first) whose float16
    output is inf or off from float32's by more than `DEPARTURE` (relative)
    while its inputs are not: where the forward pass leaves float32's, a
    sum or square inside the layer included. Failing that, of the first
    whose float16 output is inf or at least `NEAR_MAX` while its float32
    output is finite (an operation after it, outside any layer, overflows).
    None if there is neither. One eager forward pass in each precision,
    from the same random state, the calls matched in order; the model's
    own call is left out (naming the whole model would not help)."""
    half = _trace(model, batch)
    with _keras.dtype_policy(_keras.all_layers(model), "float32"):
        full = _trace(model, batch)
    pairs = []
    for h, f in zip(half, full):
        if h.layer is not f.layer:
            break  # The calls diverged (a layer that branches on its dtype).
        if h.layer is not model:
            pairs.append((h, f))
    for h, f in pairs:
        inputs_agree = _departure(h.inputs, f.inputs) <= DEPARTURE
        if inputs_agree and _departure(h.outputs, f.outputs) > DEPARTURE:
            return nonfinite.layer_path(h.layer)
    for h, f in pairs:
        if h.amax16 >= NEAR_MAX and all(np.all(np.isfinite(o)) for o in f.outputs):
            return nonfinite.layer_path(h.layer)
    return None


def _trace(model, batch) -> list:
    """The `_Call`s of one eager forward pass, in the order they complete."""
    calls = []

    def record(layer, inputs, outputs):
        float16 = [t for t in _float_tensors(outputs) if t.dtype == tf.float16]
        calls.append(
            _Call(
                layer=layer,
                inputs=[_as_array(t) for t in _float_tensors(inputs)],
                outputs=[_as_array(t) for t in _float_tensors(outputs)],
                amax16=_amax(float16),
            )
        )

    batch.rewind()
    with _keras.layer_calls(record):
        model(batch.x, training=batch.training)
    return calls


def _float_tensors(structure) -> list:
    return [
        t for t in keras.tree.flatten(structure)
        if tf.is_tensor(t) and t.dtype.is_floating
    ]


def _as_array(tensor) -> np.ndarray:
    return np.asarray(tf.cast(tensor, tf.float32))


def _amax(tensors) -> float:
    """The largest magnitude over `tensors`, inf if an element is not
    finite, 0.0 if there are none.

    >>> _amax([tf.constant([1.0, -3.0], tf.float16), tf.constant([2.0])])
    3.0
    >>> _amax([tf.constant([1.0, float("nan")], tf.float16)])
    inf
    """
    largest = 0.0
    for array in map(_as_array, tensors):
        if not np.all(np.isfinite(array)):
            return math.inf
        largest = max(largest, float(np.max(np.abs(array), initial=0.0)))
    return largest


def _departure(values, reference) -> float:
    """|values - reference| / |reference| over the arrays pooled, elements
    equal in both (inf included, as a -inf attention mask is) counting 0 and
    the norm taken over float32's finite elements; inf if any other element
    is not finite or the shapes differ.

    >>> _departure([np.array([1.0, -np.inf])], [np.array([1.0, -np.inf])])
    0.0
    >>> _departure([np.array([0.0, np.inf])], [np.array([3.0, 4.0])])
    inf
    >>> _departure([np.zeros(2)], [np.array([3.0, 4.0])])
    1.0
    """
    if [v.shape for v in values] != [r.shape for r in reference]:
        return math.inf
    if not values:
        return 0.0
    values = np.concatenate([np.ravel(v) for v in values]).astype(np.float64)
    reference = np.concatenate([np.ravel(r) for r in reference]).astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf, where they are equal
        difference = np.where(values == reference, 0.0, values - reference)
    if not np.all(np.isfinite(difference)):
        return math.inf
    norm = np.linalg.norm(np.where(np.isfinite(reference), reference, 0.0))
    distance = np.linalg.norm(difference)
    return float(distance / norm) if norm else (math.inf if distance else 0.0)


def _are(what: str) -> str:
    """The verb for `what` (`nonfinite.WEIGHTS`, "weight gradients", is
    plural; `nonfinite.INPUTS`, "input gradient", singular)."""
    return "are" if what.endswith("s") else "is"


def _locate_non_finite(probe, grads, states):
    """Names the first scaling point, walking from the loss, whose incoming
    gradient is finite but whose own backward pass produced non-finite
    values (`locate`), from a probe pass of the instrumented model `probe`
    whose `states` (`_point_rows`) hold each point's incoming amax."""
    plan = probe.plan
    index = {id(v): i for i, v in enumerate(probe.uninstrumented().trainable_variables)}
    incoming = {
        point.call: bool(np.isfinite(values["amax"]))
        for values, point in zip(states, plan.points)
    }

    def weights_finite(call_index):
        weights = plan.calls[call_index].operation.trainable_weights
        return _finite([grads[index[id(v)]] for v in weights if id(v) in index])

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
