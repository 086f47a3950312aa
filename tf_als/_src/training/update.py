"""Writing what a backward pass chose and measured into the model's state,
in the `apply` of the optimizer that applies the pass's gradients.

The scaling points choose their scales inside the backward pass, each from
the gradient it is applied to (`backward`), and leave their choices
in the model's `pass_record.PassRecord`. After the step, the
optimizer calls `write_pass`, which

1. writes every reached point's scale into the state (one variable write,
   whatever the number of points), unless the step's gradients were not
   finite: what `tf_als.scales()` reports, and, under the paper's rule,
   the scale the points apply until the next update (so a skipped step's
   choice never serves);
2. counts the steps in a row on which every reached point's incoming
   gradient was exactly zero (`zero_gradient_steps`: one reduction over
   the amaxes the points measured anyway, no branch), which
   `silent` reads;
3. on telemetry steps (every `telemetry_interval` steps), tallies every
   point's sample of its incoming gradient at once
   (`tallies.telemetry_tallies`),
   derives the statistics and histograms of all points at once
   (`tallies.statistics_of_tallies`), adds the forward headroom the
   forward pass measured (`choice.Choice.measure_forward`: the
   exact amax and near-maximum share of each point's float16 outputs) and
   writes the records: one branch for the whole model, never one per
   point.

4. on every step, skipped or not, each point's gain (`write_gains`): how
   much larger its weight gradients came out than the gradient it
   received, from the amax of each gradient the optimizer read anyway to
   check that it is finite; the point's next scale keeps them within
   float16 (`rule.produced_headroom`).

Nothing is exchanged between replicas: each replica's points chose from
its own gradients and unscaled its own weight gradients before Keras sums
them, so each replica records its own (see docs/distributed.md).
"""

import tensorflow as tf

from tf_als._src.scaling import rule

from tf_als._src.scaling import tallies
from tf_als._src.training import state as state_module


def write_pass(model, step, keep, telemetry_due, config) -> None:
    """Writes the latest backward pass of `model` (in the graph being
    traced, or eagerly the latest) into its state: the scales when `keep`
    (the gradients were finite, and under the paper's rule the step was
    an update step), the telemetry records when `telemetry_due`
    (a skipped step's too: they show what was not finite). Points the
    pass did not reach keep their rows. Does nothing when no pass of the
    model ran here (its gradients came from elsewhere).

    Args:
        model: the `tf_als.InstrumentedModel`.
        step: int64 scalar, the optimizer step the pass's gradients were
            applied at (or skipped at).
        keep: bool scalar, whether to write the scales.
        telemetry_due: bool scalar, whether to write the records.
        config: the optimizer's `config.ScalingConfig`.
    """
    records = model.pass_record.latest()
    if not records:
        return
    state = model.scaling_state
    points = sorted(records)
    rows = tf.constant([[p] for p in points], tf.int32)
    chosen = tf.stack([records[p].scale for p in points])
    current = tf.convert_to_tensor(state.scales)
    state.scales.assign(
        tf.where(keep, tf.tensor_scatter_nd_update(current, rows, chosen), current)
    )
    count_zero_gradients(state, tf.stack([records[p].amax for p in points]))
    write_telemetry(model, records, rows, chosen, step, telemetry_due, config)


def write_telemetry(model, records, rows, chosen, step, telemetry_due, config) -> None:
    """`write_pass`'s telemetry: when `telemetry_due`, the records,
    histograms and last-update steps of the points in `records` (their
    `PointRecord`s by point index; `rows`, the sorted indices as
    [points, 1]), which applied `chosen` ([points] scales), in one branch
    for the whole model."""
    state = model.scaling_state
    points = sorted(records)
    forward = model.pass_record.latest_forward()

    def telemetry():
        values, histograms = _telemetry_rows(
            records, forward, points, chosen, config
        )
        steps = tf.fill([len(points)], tf.cast(step, tf.int64))
        writes = [
            state.records.assign(_scatter(state.records, rows, values)),
            state.histograms.assign(_scatter(state.histograms, rows, histograms)),
            state.last_updates.assign(_scatter(state.last_updates, rows, steps)),
        ]
        with tf.control_dependencies(writes):
            return tf.constant(True)

    tf.cond(telemetry_due, telemetry, lambda: tf.constant(False))


def _telemetry_rows(records, forward, points, chosen, config):
    """`(records, histograms)` rows of `points` (in `RECORD_FIELDS` order)
    from their `PointRecord`s and `chosen` scales: the statistics of each
    incoming gradient's sample, and the forward headroom of each point's
    float16 outputs (a full pass over each: telemetry steps only)."""
    counts = tallies.telemetry_tallies(
        [records[p].samples for p in points],
        tf.stack([records[p].amax for p in points]),
    )
    statistics, histograms = tallies.statistics_of_tallies(
        counts, config.underflow_rate
    )
    scale_in = chosen * tf.stack([records[p].scale_out for p in points])
    empty = rule.forward_tallies([])
    headroom = rule.headroom_of_tallies(*[
        tf.stack([forward.get(p, empty)[i] for p in points]) for i in range(3)
    ])
    values = state_module.record_vector(
        scale_in, statistics, tf.unstack(headroom, axis=1), axis=1
    )
    return values, histograms


def write_gains(model, produced, scale) -> None:
    """Writes each point's gain into `model.scaling_state.gains`
    (`rule.held_gain` of what it kept and what it measured): the amax
    of the weight gradients it produced (`produced`: id of a gradient as
    the optimizer received it -> its amax once divided by S and T_in, in
    true units) over the
    amax of the gradient it received, brought to true units (divided by
    `scale`, the step's global scale, and by the T_out it carried). The
    largest over a point's variables; inf when one was not finite while the
    received gradient was. A point whose received gradient was zero or not
    finite, or none of whose weight gradients reached the optimizer as it
    produced them, keeps its gain: a variable several calls read (a shared
    layer) or that a regularizer's term reaches has a summed gradient,
    which no single point produced. Nothing is written when no pass of the
    model ran here."""
    records = model.pass_record.latest()
    points = [
        p for p in sorted(records)
        if any(id(g) in produced for g in records[p].products)
    ]
    if not points:
        return
    state = model.scaling_state
    owners, amaxes = [], []  # Each product's amax and its point's row.
    for row, p in enumerate(points):
        for g in records[p].products:
            if id(g) in produced:
                owners.append(row)
                amaxes.append(produced[id(g)])
    amaxes = tf.stack(amaxes)
    # One segment maximum for every point (a non-finite amax as inf: the
    # maximum of a segment holding NaN depends on the order).
    weights = tf.math.unsorted_segment_max(  # (XLA has no sorted one.)
        tf.where(tf.math.is_finite(amaxes), amaxes, float("inf")),
        tf.constant(owners, tf.int32), len(points),
    )
    received = tf.stack([records[p].amax for p in points]) / (
        tf.cast(scale, tf.float32) * tf.stack([records[p].scale_out for p in points])
    )
    gains = weights / received
    gains = tf.where(tf.math.is_finite(gains), gains, float("inf"))
    measured = tf.logical_and(tf.math.is_finite(received), received > 0.0)
    rows = tf.constant([[p] for p in points], tf.int32)
    current = tf.gather(tf.convert_to_tensor(state.gains), rows[:, 0])
    kept = tf.where(measured, rule.held_gain(gains, current), current)
    state.gains.assign(_scatter(state.gains, rows, kept))


def count_zero_gradients(state, amaxes) -> None:
    """Advances `state.zero_gradient_steps`: one more when every amax in
    `amaxes` (float32 [points], the incoming gradients' amax of the points
    a pass reached) is exactly 0, else back to 0 (a non-finite amax, a
    skipped step, resets it too). One reduction, no branch.

    >>> from tf_als._src.training import state as state_module
    >>> state = state_module.ScalingState(["a", "b"])
    >>> count_zero_gradients(state, tf.constant([0.0, 0.0]))
    >>> count_zero_gradients(state, tf.constant([0.0, -0.0]))
    >>> int(state.zero_gradient_steps.numpy())
    2
    >>> count_zero_gradients(state, tf.constant([0.0, 2.0**-24]))
    >>> int(state.zero_gradient_steps.numpy())
    0
    """
    zero = tf.reduce_all(tf.equal(amaxes, 0.0))
    counter = tf.convert_to_tensor(state.zero_gradient_steps)
    state.zero_gradient_steps.assign(tf.where(zero, counter + 1, 0))


def _scatter(variable, rows, values):
    """`variable`'s value with `rows` replaced by `values` (a synchronised-
    on-read variable takes no scatter of its own)."""
    current = tf.convert_to_tensor(variable)
    return tf.tensor_scatter_nd_update(current, rows, tf.cast(values, current.dtype))
