"""Choosing new per-layer scales: once per update, in the optimizer's apply.

On an update step the backward pass runs with the scales in force and only
measures: each scaling point stores the tally of its incoming gradient
(`tf_als.rule.tally`: amax and a count per binary exponent) and the scale
T_out that gradient carried, in its row of the model's
`tf_als.state.ScalingState` (each replica its own copy).
The optimizer's `apply` then calls `update_scales`, which

1. reads every point's measurement (one `[points, ...]` variable) and,
   with several replicas, exchanges it in a single all-gather (the max of
   amax, the sum of the counts: every replica then decides from the tally
   of the global batch);
2. walks the points from the outputs back, as the backward pass does, to
   find the lift T_out each point's gradient will carry. A point's
   measurement was taken under the old scales downstream of it; those may
   just have changed, and the scales are powers of two, so the gradient it
   will receive is its measured gradient times T_out(new) / T_out(old),
   exactly. The walk adds and clips exponents: the amax each point chooses
   its scale from (`tf_als.rule.choose_scale`) moves by the change in T_out;
3. shifts every tally by its factor (`tf_als.rule.shift_tallies`), derives
   the statistics and histograms of all points at once
   (`tf_als.rule.statistics_of_tallies`), and writes the new scales and
   records: four variable writes, whatever the number of points.

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
    backward passes measured since the last update (the latest measurement
    of each point), and records `step` as the points' last update. Points
    no measuring pass reached (no gradient arrived) keep their scale and
    record.

    Runs in a replica context (or with no strategy); with several replicas
    in sync, every replica must call it (it all-gathers once).

    Args:
        model: the `tf_als.InstrumentedModel`.
        step: int64 scalar, the optimizer step being applied.
        backoff: float32 scalar >= 1, see `tf_als.rule.choose_scale`.
        config: the optimizer's `tf_als.config.ScalingConfig`.

    Returns:
        A bool scalar that is True once every variable is written.
    """
    state = model.scaling_state
    measured = across_replicas(_read(state.measured))
    reached = _read(state.pending) > 0
    current = _read(state.scales)
    t_out, exponents = _walk(model, measured, reached, current, backoff, config)
    # Everything else at once, over [points, ...] tensors.
    tallies = rule.shift_tallies(
        measured[:, 1:], _pow2.pow2(t_out - _pow2.floor_log2(measured[:, 0]))
    )
    statistics, shifted_histograms = rule.statistics_of_tallies(
        tallies, config.underflow_rate
    )
    records = state_module.record_vector(
        _pow2.pow2(exponents + t_out), statistics, axis=1
    )
    column = reached[:, tf.newaxis]
    assigns = [
        state.scales.assign(_pow2.pow2(exponents)),
        state.records.assign(tf.where(column, records, _read(state.records))),
        state.histograms.assign(
            tf.where(column, shifted_histograms, _read(state.histograms))
        ),
        state.last_updates.assign(tf.where(reached, step, _read(state.last_updates))),
        state.pending.assign(tf.zeros_like(_read(state.pending))),
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
    amax = measured[:, 1]  # [scale_out, tally], a tally starting with amax
    safe = rule.safe_exponent(amax, config.overflow_margin, backoff)
    usable = tf.logical_and(rule.usable_amax(amax, backoff), reached)
    kept = _pow2.floor_log2(current)
    # A point whose gradient arrives lifted by 2**inherited (instead of the
    # 2**then it was measured with) may take exponent safe + then -
    # inherited, clipped to [-inherited, ceiling]: its T_in exponent is
    # min(max(safe + then, 0), ceiling + inherited). Only the last clip
    # depends on the walk.
    wanted = tf.maximum(safe + _pow2.floor_log2(measured[:, 0]), 0)
    ceiling = tf.constant(int(math.log2(config.max_layer_scale)))
    unreached, zero = tf.constant(UNREACHED), tf.constant(0)
    per_point = zip(
        tf.unstack(wanted), tf.unstack(usable), tf.unstack(kept), tf.unstack(reached)
    )
    per_point = list(per_point)
    t_out = [None] * len(per_point)

    def decide(index, inherited):
        wanted_, usable_, kept_, reached_ = per_point[index]
        t_out[index] = inherited
        t_in = tf.where(
            usable_, tf.minimum(wanted_, ceiling + inherited), kept_ + inherited
        )
        return tf.where(reached_, t_in, unreached)

    scales = algebra.Scales(model.plan, unit=0)
    scales_in = {}
    for call in reversed(model.plan.calls):
        if call.point is None:
            continue
        inherited = scales.call(call)
        t_in = decide(call.point, zero if inherited is None else inherited)
        scales.point_scales[call.index] = scales_in[call.point] = t_in
    for index, inner in model.inner_points:
        parent = zero if inner.parent is None else scales_in[inner.parent]
        scales_in[index] = decide(index, parent)
    t_out = tf.stack(t_out)
    chosen = tf.where(usable, tf.minimum(wanted, ceiling + t_out) - t_out, kept)
    return t_out, chosen


def _read(variable):
    return tf.convert_to_tensor(variable)


def replicas_in_sync():
    context = tf.distribute.get_replica_context()
    return 1 if context is None else context.num_replicas_in_sync


def across_replicas(measured):
    """`measured` ([points, 1 + TALLY_SIZE] rows of `[scale_out, tally]`)
    reduced over the replicas in sync with one all-gather: the maximum of
    the incoming scale (the same on every replica) and of amax, the sum of
    the exponent counts, so every replica decides from the tally of the
    global batch, as one device would. Unchanged with one replica. A NaN
    amax on any replica stays NaN, as it would on one device (where it
    keeps the scale); a max reduction may drop NaN."""
    replicas = replicas_in_sync()
    if replicas == 1:
        return measured
    context = tf.distribute.get_replica_context()
    gathered = context.all_gather(measured[tf.newaxis], axis=0)
    gathered = tf.reshape(gathered, [replicas] + measured.shape.as_list())
    maxima = rule.nan_max(gathered[:, :, :2], 0)
    counts = tf.reduce_sum(gathered[:, :, 2:], 0)
    return tf.concat([maxima, counts], 1)
