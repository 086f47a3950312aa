"""Which steps record telemetry, and which update the paper rule's scales.

The optimizer that applies an instrumented model's gradients counts its
`apply` calls (micro-steps: with gradient accumulation on the inner
optimizer, several calls make one applied step). A call is due for an
interval when it applies (the last micro-step of an accumulation) and its
applied step is a multiple of the interval: every `telemetry_interval`
steps the optimizer writes the telemetry records, and, under the paper's
rule, every `update_interval` steps the points re-choose their scales;
after each call the optimizer writes into the model's state whether the
next call is such a step (`state.ScalingState.due`), since the
backward pass runs before the optimizer sees the step. A skipped
(non-finite) step does not advance the counter, so its retry is due again.

>>> int(due_at(tf.constant(0, tf.int64), accumulation=1, interval=100))
1
>>> [int(due_at(tf.constant(i, tf.int64), accumulation=4, interval=2))
...  for i in range(12)]
[0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1]
"""

import tensorflow as tf


def applies(micro_step, accumulation: int) -> tf.Tensor:
    """Whether the `apply` call numbered `micro_step` (int64, from 0)
    applies gradients, with `accumulation` calls per applied step (1: no
    accumulation). Keras applies on the last call of each group."""
    return tf.equal(tf.math.floormod(micro_step + 1, accumulation), 0)


def due_at(micro_step, accumulation: int, interval: int) -> tf.Tensor:
    """1 (int64) when the `apply` call numbered `micro_step` is due: it
    applies, and its applied step is a multiple of `interval`; else 0."""
    applied_step = tf.math.floordiv(micro_step + 1, accumulation) - 1
    due = tf.logical_and(
        applies(micro_step, accumulation),
        tf.equal(tf.math.floormod(applied_step, interval), 0),
    )
    return tf.cast(due, tf.int64)
