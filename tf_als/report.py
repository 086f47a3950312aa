"""`diagnose(model, x, y)`: one batch in float32, in float16 with Keras's
global loss scaling, and in float16 with tf_als, compared layer by layer."""

import dataclasses
import math
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from tf_als import composite
from tf_als import graph
from tf_als.instrument import InstrumentedModel
from tf_als.optimizer import AdaptiveLossScaleOptimizer

MAX_HALVINGS = 64
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
            finite gradients (it starts at 2**15 and halves, as in training).
        als_loss_scale: the same for tf_als.
        non_finite: when gradients at the starting scale were not finite,
            which layer they first became non-finite in (walking from the
            loss towards the inputs); None otherwise.
    """

    rows: tuple
    keras_loss_scale: float
    als_loss_scale: float
    non_finite: Optional[str]

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
            f"global loss scale: keras {self.keras_loss_scale:g}, "
            f"tf_als {self.als_loss_scale:g}",
            header,
            "-" * len(header),
        ]
        for r in self.rows:
            lines.append(
                f"{r.point:<{width}} {r.keras_underflow:>15.2%} "
                f"{r.keras_error:>11.2e} {r.als_underflow:>16.2%} "
                f"{r.als_error:>12.2e} {r.als_scale:>12g}"
            )
        if self.non_finite:
            lines.append(f"non-finite gradients: {self.non_finite}")
        return "\n".join(lines)


def diagnose(model, x, y, loss=None, *, training=True, verbose=True) -> Diagnosis:
    """Compares float32, Keras's loss scaling and tf_als on one batch.

    Works on a plain Sequential/Functional model or on one returned by
    `tf_als.instrument` (neither is changed: the comparison uses copies and
    a fresh instrumentation sharing the layers). The float16 runs use the
    model's own layers when it computes in float16, else a mixed_float16
    copy; the reference is a float32 copy with the same weights.

    Args:
        model: a built Sequential/Functional model, or an instrumented one.
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
    report.underflowing()   # ["dense", "dense_1"]
    ```
    """
    source = model.model if isinstance(model, InstrumentedModel) else model
    loss_fn = _loss_function(model, loss)
    if graph.is_subclassed(source):
        raise TypeError(
            f"diagnose() needs a Sequential or Functional model; "
            f"{type(source).__name__} {source.name!r} is subclassed, and "
            "diagnose() rebuilds its float32 reference from the layer graph. "
            "Instrumenting and training it work; to diagnose, run the same "
            "layers in a Functional model (`keras.Model(inputs, model(inputs))`)."
        )
    graph.functional_of(source)  # Any other model: a clear error.
    mixed = source if _computes_in_float16(source) else _clone(source, "mixed_float16")
    reference = _clone(source, "float32")

    expected = _gradients(reference, reference.trainable_variables, x, y, loss_fn, training)
    start = 2.0**15

    def keras_gradients(scale):
        return _gradients(mixed, mixed.trainable_variables, x, y, loss_fn, training, scale)

    keras_grads, keras_scale = _until_finite(keras_gradients, start)

    def als_gradients(scale, max_layer_scale=2.0**15):
        instrumented = InstrumentedModel(mixed)
        optimizer = AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(0.0),
            initial_scale=scale,
            update_interval=1,
            max_layer_scale=max_layer_scale,
        )
        grads = _gradients(
            instrumented, instrumented.trainable_variables, x, y, loss_fn,
            training, scale, optimizer,
        )
        return grads, instrumented

    (als_grads, instrumented), als_scale = _until_finite(
        lambda s: als_gradients(s), start, pair=True
    )

    non_finite = None
    if keras_scale != start or not _finite(keras_grads):
        # Replay Keras's first step through scaling points held at 1, which
        # record where the gradient stops being finite.
        probe_grads, probe = als_gradients(start, max_layer_scale=1.0)
        non_finite = _locate_non_finite(probe, mixed, probe_grads)

    rows = _rows(instrumented, mixed, expected, keras_grads, als_grads)
    diagnosis = Diagnosis(
        rows=tuple(rows),
        keras_loss_scale=keras_scale,
        als_loss_scale=als_scale,
        non_finite=non_finite,
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


def _computes_in_float16(model):
    return any(
        getattr(call.operation, "compute_dtype", None) == "float16"
        for call in graph.read(model).calls
    )


def _clone(model, policy):
    def clone_layer(layer):
        config = layer.get_config()
        if not isinstance(layer, keras.layers.InputLayer):
            config["dtype"] = policy
        return layer.__class__.from_config(config)

    # clone_model also compiles the copy from the model's compile config,
    # which fails for unregistered custom losses or optimizers and which
    # the copy does not need; the flag is restored at once.
    compiled = getattr(model, "compiled", False)
    model.compiled = False
    try:
        clone = keras.models.clone_model(model, clone_function=clone_layer)
    finally:
        model.compiled = compiled
    clone.set_weights(model.get_weights())
    return clone


def _gradients(model, variables, x, y, loss_fn, training, scale=1.0, optimizer=None):
    """The scaled gradients of one batch divided by `scale`, computed in a
    `tf.function` as `fit` computes them (on some CPUs TensorFlow's graph
    kernels round float16 differently from its eager ones)."""

    @tf.function
    def compute(x, y):
        with tf.GradientTape() as tape:
            value = loss_fn(y, model(x, training=training))
            if optimizer is not None:
                scaled = optimizer.scale_loss(value)
            else:
                scaled = value * scale
        grads = tape.gradient(scaled, variables)
        return [None if g is None else tf.convert_to_tensor(g) for g in grads]

    return [
        None if g is None else np.asarray(g, np.float64) / scale
        for g in compute(x, y)
    ]


def _finite(grads):
    return all(g is None or np.all(np.isfinite(g)) for g in grads)


def _until_finite(compute, scale, pair=False):
    """Halves the scale until the gradients are finite, as dynamic loss
    scaling would over the next steps."""
    result = compute(scale)
    for _ in range(MAX_HALVINGS):
        grads = result[0] if pair else result
        if _finite(grads):
            return result, scale
        scale /= 2.0
        result = compute(scale)
    return result, scale


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


def _rows(instrumented, mixed, expected, keras_grads, als_grads):
    """A row per scaling point with weight gradients of its own: every
    weighted layer, inside opened composites too."""
    index = {id(v): i for i, v in enumerate(mixed.trainable_variables)}
    rows = []
    for point, layer in zip(instrumented.scaling_points, instrumented.point_layers):
        positions = [
            index[id(v)] for v in composite.point_weights(layer) if id(v) in index
        ]
        if not positions:
            continue  # Frozen, or an opened layer without weights of its own.

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


def _locate_non_finite(probe, mixed, grads):
    """Walks the scaling points from the loss towards the inputs and names
    the first whose incoming gradient is finite but whose own backward pass
    produced non-finite values (in its weight gradients, or in the gradient
    it passes on to the scaling points that feed it)."""
    plan = probe.plan
    index = {id(v): i for i, v in enumerate(mixed.trainable_variables)}
    incoming = {
        call_index: np.isfinite(point.read()["amax"])
        for point, call_index in zip(probe.scaling_points, plan.point_calls)
    }
    names = {
        call_index: point.point_name
        for point, call_index in zip(probe.scaling_points, plan.point_calls)
    }
    for call_index in reversed(plan.point_calls):
        if not incoming[call_index]:
            continue
        layer = plan.calls[call_index].operation
        weights = [grads[index[id(v)]] for v in layer.trainable_weights if id(v) in index]
        weights_finite = all(g is None or np.all(np.isfinite(g)) for g in weights)
        feeders = graph.upstream_points(plan, plan.calls[call_index])
        passes_non_finite = any(not incoming[f] for f in feeders)
        if not weights_finite or passes_non_finite:
            what = "weight gradients" if not weights_finite else "input gradient"
            return (
                f"layer {layer.name!r} (scaling point {names[call_index]!r}): "
                f"the gradient reaching it is finite, its {what} is not. "
                "Check that layer's weights and inputs for very large values; "
                "dynamic loss scaling lowers the global scale until it fits."
            )
    if incoming:
        last = names[plan.point_calls[-1]]
        return (
            f"before the first scaling point: the gradient reaching {last!r} "
            "(closest to the loss) is already non-finite. Check the loss, "
            "the labels and the model outputs for NaN or inf."
        )
    return None
