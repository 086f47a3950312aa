"""The gradient passes `diagnose` compares: one batch's gradients, from
the same random state every time (`same_randomness`, `Batch.rewind`), in
a function traced once and re-run at each lower global scale until they
are finite (`until_finite`), as dynamic loss scaling would over the next
steps.
"""

import contextlib
from typing import Any, Callable, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from tf_als._src.model import _keras

MAX_HALVINGS = 64


START_SCALE = 2.0**15


class Batch(NamedTuple):
    """One batch and how to run it; `rewind()` goes first in every run."""

    x: Any
    y: Any
    loss_fn: Callable
    training: bool
    rewind: Callable[[], None]


@contextlib.contextmanager
def same_randomness(model):
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


def gradient_pass(model, variables, batch, config=None, *, compiled=True):
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
    points = []  # The points the pass reached, in the order of `chosen`.
    compute = _compute(model, variables, batch, config, points)
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


def _compute(model, variables, batch, config, points):
    """`compute(x, y, scale)` for `gradient_pass`: the gradients of
    `variables` of `batch.loss_fn` times `scale`, the loss, and with
    `config` the chosen scales, T_in and amax of the points reached, whose
    indices it leaves in `points`."""
    loss_fn, training = batch.loss_fn, batch.training

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

    return compute


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


def finite(grads):
    return all(g is None or np.all(np.isfinite(g)) for g in grads)


def until_finite(compute):
    """(result, scale): halves the scale from 2**15 until the gradients are
    finite, as dynamic loss scaling would over the next steps; the scale is
    None when none of `MAX_HALVINGS` halvings gave finite gradients."""
    scale = START_SCALE
    for _ in range(MAX_HALVINGS + 1):
        result = compute(scale)
        if finite(result[0]):
            return result, scale
        if isinstance(result[1], float) and not np.isfinite(result[1]):
            break  # The loss itself: no scale helps.
        scale /= 2.0
    return result, None
