"""Writing what a backward pass chose and measured into the model's state,
in the `apply` of the optimizer that applies the pass's gradients.

The scaling points choose their scales inside the backward pass, each from
the gradient it is applied to (`tf_als.backward`), and leave their choices
in the model's `tf_als.pass_record.PassRecord`. After the step, the
optimizer calls `write_pass`, which

1. writes every reached point's scale into the state (one variable write,
   whatever the number of points), unless the step's gradients were not
   finite: what `tf_als.scales()` reports, and, under the paper's rule,
   the scale the points apply until the next update (so a skipped step's
   choice never serves);
2. on telemetry steps (every `telemetry_interval` steps), tallies each
   point's sample of its incoming gradient (`tf_als.rule.telemetry_tally`),
   derives the statistics and histograms of all points at once
   (`tf_als.rule.statistics_of_tallies`) and writes the records: one
   branch for the whole model, never one per point.

Nothing is exchanged between replicas: each replica's points chose from
its own gradients and unscaled its own weight gradients before Keras sums
them, so each replica records its own (see docs/distributed.md).
"""

import tensorflow as tf

from tf_als import rule
from tf_als import state as state_module


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
        config: the optimizer's `tf_als.config.ScalingConfig`.
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

    def telemetry():
        tallies = tf.stack(
            [
                rule.telemetry_tally(list(records[p].samples), records[p].amax)
                for p in points
            ]
        )
        statistics, histograms = rule.statistics_of_tallies(
            tallies, config.underflow_rate
        )
        scale_in = chosen * tf.stack([records[p].scale_out for p in points])
        values = state_module.record_vector(scale_in, statistics, axis=1)
        steps = tf.fill([len(points)], tf.cast(step, tf.int64))
        writes = [
            state.records.assign(_scatter(state.records, rows, values)),
            state.histograms.assign(_scatter(state.histograms, rows, histograms)),
            state.last_updates.assign(_scatter(state.last_updates, rows, steps)),
        ]
        with tf.control_dependencies(writes):
            return tf.constant(True)

    tf.cond(telemetry_due, telemetry, lambda: tf.constant(False))


def _scatter(variable, rows, values):
    """`variable`'s value with `rows` replaced by `values` (a synchronised-
    on-read variable takes no scatter of its own)."""
    current = tf.convert_to_tensor(variable)
    return tf.tensor_scatter_nd_update(current, rows, tf.cast(values, current.dtype))
