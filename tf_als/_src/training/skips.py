"""Skipped steps: the counters an `AdaptiveLossScaleOptimizer` keeps of
them, and the checks that read them.

The counters are int32 variables the optimizer makes in its `build` (so
checkpoints, `tf.function` and replicas see them), written in its
finite/non-finite branches and read by `failures.recovery` and
`failures.storm`:

    consecutive_skips    steps skipped in a row
    loss_finite          whether the latest scaled loss was finite
                         (1, 0; -1: not recorded)
    first_non_finite     at the first skipped step of the streak:
                         [index of the trainable variable closest to the
                         loss whose gradient was not finite (-1: none),
                         how many were not finite, loss_finite then]
    window_steps         steps in the current window of
    window_skips         2 * max_consecutive_skips steps, and skipped ones

On a finite step the streak ends; on every step the window counts it,
and a full window starts a new one. With `max_consecutive_skips=None`
the window is not kept (nothing reads it).
"""

import keras
import tensorflow as tf

# (name, shape, initial value) of each counter, in the order the optimizer
# makes them (a checkpoint indexes an optimizer's variables by position).
COUNTERS = (
    ("consecutive_skips", (), 0),
    ("loss_finite", (), -1),
    ("first_non_finite", (3,), -1),
    ("window_steps", (), 0),
    ("window_skips", (), 0),
)

def add_counters(optimizer) -> None:
    """Makes the counters (`COUNTERS`) as variables of `optimizer`, in its
    `build`, each an attribute of that name."""
    for name, shape, value in COUNTERS:
        variable = optimizer.add_variable(
            shape=shape,
            dtype="int32",
            initializer=keras.initializers.Constant(value),
            aggregation="none",
            name=name,
        )
        setattr(optimizer, name, variable)


def record_loss(optimizer, loss) -> None:
    """Records whether `loss` (before scaling) is finite."""
    finite = tf.reduce_all(
        tf.math.is_finite(tf.cast(tf.convert_to_tensor(loss), tf.float32))
    )
    optimizer.loss_finite.assign(tf.cast(finite, tf.int32))


def finite_step(optimizer) -> None:
    """Counts a step whose gradients were applied."""
    optimizer.consecutive_skips.assign(0)
    _count_window(optimizer, skipped=0)


def skipped_step(optimizer) -> None:
    """Counts a step skipped for non-finite gradients."""
    optimizer.consecutive_skips.assign_add(1)
    _count_window(optimizer, skipped=1)


def record_first_skip(optimizer, flags) -> None:
    """After Keras's apply: if this step began a streak of skipped steps,
    records where its gradients were not finite, from `flags`
    (`replicas.finite_flags` of this replica's own gradients, a bool
    vector)."""

    def record():
        bad = tf.logical_not(flags)
        if bad.shape[0] == 0:  # No gradient: nothing was bad.
            bad = tf.constant([False])
        positions = tf.range(tf.size(bad, out_type=tf.int32))
        optimizer.first_non_finite.assign(
            tf.stack(
                [
                    tf.reduce_max(tf.where(bad, positions, -1)),
                    tf.reduce_sum(tf.cast(bad, tf.int32)),
                    tf.convert_to_tensor(optimizer.loss_finite),
                ]
            )
        )
        return tf.constant(True)

    first = tf.equal(optimizer.consecutive_skips, 1)
    tf.cond(first, record, lambda: tf.constant(False))


def reset(optimizer) -> None:
    """Forgets every skip: a new start (after a promotion, or a global
    scale set anew)."""
    optimizer.consecutive_skips.assign(0)
    optimizer.window_steps.assign(0)
    optimizer.window_skips.assign(0)
    optimizer.loss_finite.assign(-1)
    optimizer.first_non_finite.assign([-1, -1, -1])


def streak(optimizer) -> int:
    """Steps skipped in a row, now (eager)."""
    return int(keras.ops.convert_to_numpy(optimizer.consecutive_skips))


def skipped_lately(optimizer) -> bool:
    """Whether a step of the current window was skipped, now (eager; one
    read). False means no streak either: a skip counts in the window it
    ends, and a window starts afresh only with the step that follows a
    full one."""
    return int(optimizer.window_skips.numpy()) > 0  # half convert_to_numpy's time


def stops(optimizer) -> bool:
    """Whether the streak reached `max_consecutive_skips` (a storm)."""
    limit = optimizer.max_consecutive_skips
    return limit is not None and streak(optimizer) >= limit


def frequent(optimizer) -> bool:
    """Whether the current window holds `max_consecutive_skips` skipped
    steps, not all in a row (a layer that overflows on some batches)."""
    limit = optimizer.max_consecutive_skips
    return limit is not None and window(optimizer)[0] >= limit


def window(optimizer) -> tuple:
    """(skipped steps, steps) in the current window, now (eager)."""
    return (
        int(keras.ops.convert_to_numpy(optimizer.window_skips)),
        int(keras.ops.convert_to_numpy(optimizer.window_steps)),
    )


def _count_window(optimizer, skipped) -> None:
    """Counts this step, and whether it was skipped, in the current window
    of 2 * max_consecutive_skips steps (a new window starts once one is
    full)."""
    if optimizer.max_consecutive_skips is None:
        return
    full = optimizer.window_steps >= 2 * optimizer.max_consecutive_skips
    optimizer.window_skips.assign(tf.where(full, 0, optimizer.window_skips) + skipped)
    optimizer.window_steps.assign(tf.where(full, 0, optimizer.window_steps) + 1)
