"""Choosing new per-layer scales: once per update, in the optimizer's apply.

On an update step the backward pass runs with the scales in force and only
measures: each scaling point stores what its incoming gradient looked like,
and the scale T_out that gradient carried, in its own state (each replica
its own copy). The optimizer's `apply` then calls `update_scales`, which

1. stacks every point's measurement into one tensor and, with several
   replicas, exchanges it in a single all-gather (the max of percentile and
   amax, the mean of the fractions: every replica then decides from the
   same numbers);
2. walks the points from the outputs back, as the backward pass does, to
   find the lift T_out each point's gradient will carry. A point's
   measurement was taken under the old scales downstream of it; those may
   just have changed, and the scales are powers of two, so the gradient it
   will receive is its measured gradient times T_out(new) / T_out(old),
   exactly for amax and the percentile. The walk carries only scalars: the
   amax each point chooses its scale from (`tf_als.rule.choose_scale`);
3. shifts every measurement by its factor (`tf_als.rule.shift_measurements`)
   and chooses the scales again, all points at once, and writes the new
   scales and the (shifted) records.

The new scales serve from the next step on. Between updates nothing here
runs, and nothing is exchanged.
"""

import math

import tensorflow as tf

from tf_als import _pow2
from tf_als import algebra
from tf_als import rule
from tf_als import state as state_module

# log2 T_in of a point no gradient reached: it constrains nothing upstream.
UNREACHED = 1 << 20


def update_scales(model, step, backoff, config):
    """Chooses and writes every scaling point's new scale from what the
    backward pass of step `step` measured. Points that step did not reach
    (no gradient arrived) keep their scale and record.

    Runs in a replica context (or with no strategy); with several replicas
    in sync, every replica must call it (it all-gathers once).

    Args:
        model: the `tf_als.InstrumentedModel`.
        step: int64 scalar, the optimizer step that measured.
        backoff: float32 scalar >= 1, see `tf_als.rule.choose_scale`.
        config: the optimizer's `tf_als.config.ScalingConfig`.

    Returns:
        A bool scalar that is True once every variable is written.
    """
    points = model.scaling_points
    measured = across_replicas(tf.stack([_read(p.measured) for p in points]))
    reached = tf.equal(tf.stack([_read(p.measured_step) for p in points]), step)
    current = tf.stack([_read(p.scale) for p in points])
    t_out, exponents = _walk(model, measured, reached, current, backoff, config)
    scales = _pow2.pow2(exponents)
    # Everything else at once, over [points, ...] tensors.
    shifted = rule.shift_measurements(
        measured[:, 1:], _pow2.pow2(t_out - _pow2.floor_log2(measured[:, 0]))
    )
    fields = len(rule.GradientStatistics._fields)
    statistics = rule.GradientStatistics(*tf.unstack(shifted[:, :fields], axis=1))
    records = tf.where(
        reached[:, tf.newaxis],
        state_module.record_vector(_pow2.pow2(exponents + t_out), statistics, axis=1),
        tf.stack([_read(p.record) for p in points]),
    )
    histograms = tf.where(
        reached[:, tf.newaxis],
        shifted[:, fields:],
        tf.stack([_read(p.histogram) for p in points]),
    )
    steps = tf.where(reached, step, tf.stack([_read(p.last_update) for p in points]))
    assigns = []
    for i, point in enumerate(points):
        assigns += [
            point.scale.assign(scales[i]),
            point.record.assign(records[i]),
            point.histogram.assign(histograms[i]),
            point.last_update.assign(steps[i]),
        ]
    with tf.control_dependencies(assigns):
        return tf.constant(True)


def _walk(model, measured, reached, current, backoff, config) -> tuple:
    """(log2 T_out, log2 of the new scale) of every point, each int32
    [points]: the points from the outputs back, as the backward pass runs,
    each choosing its scale for the gradient as it will arrive, scaled by
    T_out(new) / T_out(old). Scales are powers of two, so the walk adds and
    clips exponents: what safety allows for each point's measured amax is
    computed once for all points (`tf_als.rule.safe_exponent`), and a
    gradient lifted by 2**f allows f less. An unreached point, or one whose
    gradient was all zero or not finite, keeps its scale."""
    amax = measured[:, 1 + rule.GradientStatistics._fields.index("amax")]
    safe = tf.unstack(rule.safe_exponent(amax, config.overflow_margin, backoff))
    usable = tf.unstack(tf.logical_and(rule.usable_amax(amax, backoff), reached))
    then = tf.unstack(_pow2.floor_log2(measured[:, 0]))
    kept = tf.unstack(_pow2.floor_log2(current))
    reached = tf.unstack(reached)
    ceiling = int(math.log2(config.max_layer_scale))
    t_out, chosen = [None] * len(then), [None] * len(then)

    def decide(index, inherited):
        inherited = tf.convert_to_tensor(inherited, tf.int32)
        exponent = safe[index] - (inherited - then[index])
        exponent = tf.minimum(tf.maximum(exponent, -inherited), ceiling)
        t_out[index] = inherited
        chosen[index] = tf.where(usable[index], exponent, kept[index])
        return tf.where(reached[index], chosen[index] + inherited, UNREACHED)

    scales = algebra.Scales(model.plan, unit=0)
    scales_in = {}
    for call in reversed(model.plan.calls):
        if call.point is None:
            continue
        inherited = scales.call(call)
        t_in = decide(call.point, 0 if inherited is None else inherited)
        scales.point_scales[call.index] = scales_in[call.point] = t_in
    for index, inner in model.inner_points:
        parent = 0 if inner.parent is None else scales_in[inner.parent]
        scales_in[index] = decide(index, parent)
    return tf.stack(t_out), tf.stack(chosen)


def _read(variable):
    return tf.convert_to_tensor(variable)


def replicas_in_sync():
    context = tf.distribute.get_replica_context()
    return 1 if context is None else context.num_replicas_in_sync


# Columns of a point's row that replicas reduce by their maximum: the
# incoming scale (the same on every replica), the percentile and amax. The
# others are fractions of equal shares of the global batch: their mean is
# the global batch's fraction.
_MAXIMUM_COLUMNS = 1 + rule.MAXIMUM_ENTRIES


def across_replicas(measured):
    """`measured` ([points, columns]) reduced over the replicas in sync with
    one all-gather (`tf.distribute.ReduceOp` has no MAX); unchanged with one
    replica. A NaN on any replica stays NaN, as it would on one device
    (where it keeps the scale); a max reduction may drop NaN."""
    replicas = replicas_in_sync()
    if replicas == 1:
        return measured
    context = tf.distribute.get_replica_context()
    gathered = context.all_gather(measured[tf.newaxis], axis=0)
    gathered = tf.reshape(gathered, [replicas] + measured.shape.as_list())
    maxima = rule.nan_max(gathered[:, :, :_MAXIMUM_COLUMNS], 0)
    means = tf.reduce_mean(gathered[:, :, _MAXIMUM_COLUMNS:], 0)
    return tf.concat([maxima, means], 1)
