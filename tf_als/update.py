"""Choosing new per-layer scales: once per update, in the optimizer's apply.

On an update step the backward pass runs with the scales in force and only
measures: each scaling point stores what its incoming gradient looked like,
and the scale T_out that gradient carried, in its own state (each replica
its own copy). The optimizer's `apply` then calls `update_scales`, which

1. stacks every point's measurement into one tensor and, with several
   replicas, exchanges it in a single all-gather (the max of percentile and
   amax, the mean of the fractions: every replica then decides from the
   same numbers);
2. walks the points from the outputs back, as the backward pass does, and
   chooses each point's scale with `tf_als.rule.choose_scale`. A point's
   measurement was taken under the old scales downstream of it; those may
   just have changed, and the scales are powers of two, so the gradient it
   will receive is its measured gradient times T_out(new) / T_out(old),
   exactly for amax and the percentile (`tf_als.rule.shift_measurement`);
3. writes the new scales and the (shifted) records.

The new scales serve from the next step on. Between updates nothing here
runs, and nothing is exchanged.
"""

import tensorflow as tf

from tf_als import algebra
from tf_als import rule
from tf_als import state as state_module

INF = float("inf")


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
    measured = tf.stack([_read(p.measured) for p in points])
    reached = tf.equal(
        tf.stack([_read(p.measured_step) for p in points]), step
    )
    measured = across_replicas(measured)
    rows = tf.unstack(measured)
    knobs = (config.max_layer_scale, config.overflow_margin, backoff)
    scales = algebra.Scales(model.plan)
    scales_in = {}
    assigns = []
    for call in reversed(model.plan.calls):
        if call.point is None:
            continue
        t_out = scales.call(call)
        t_out = 1.0 if t_out is None else t_out
        t_in, written = _decide(
            points[call.point], rows[call.point], reached[call.point], t_out, step, knobs
        )
        scales.point_scales[call.index] = scales_in[call.point] = t_in
        assigns += written
    for index, inner in model.inner_points:
        t_out = 1.0 if inner.parent is None else scales_in[inner.parent]
        t_in, written = _decide(
            points[index], rows[index], reached[index], t_out, step, knobs
        )
        scales_in[index] = t_in
        assigns += written
    with tf.control_dependencies(assigns):
        return tf.constant(True)


def _decide(point, row, reached, t_out, step, knobs):
    """One point's new scale from its measurement `row` ([T_out then,
    measurement]); returns its new T_in (+inf when unreached, which
    constrains nothing upstream) and the assignments."""
    max_layer_scale, overflow_margin, backoff = knobs
    t_out = tf.cast(t_out, tf.float32)
    shifted = rule.shift_measurement(row[1:], t_out / row[0])
    statistics, histogram = rule.split_measurement(shifted)
    current = _read(point.scale)
    scale = rule.choose_scale(
        statistics, current, max_layer_scale, overflow_margin, backoff, t_out
    )
    scale = tf.where(reached, scale, current)
    record = state_module.record_vector(scale * t_out, statistics)
    assigns = [
        point.scale.assign(scale),
        point.record.assign(tf.where(reached, record, _read(point.record))),
        point.histogram.assign(
            tf.where(reached, histogram, _read(point.histogram))
        ),
        point.last_update.assign(tf.where(reached, step, _read(point.last_update))),
    ]
    return tf.where(reached, scale * t_out, INF), assigns


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
