"""What an `AdaptiveLossScaleOptimizer` hands the instrumented models it
trains: itself (`receive`: the models whose variables an `apply` received
learn who trains them), and what their next backward pass needs.

The backward pass runs before the optimizer sees the step, so after each
`apply` (and after a restart, `failures.recovery`) the optimizer writes
into the model's `state.ScalingState`:

    backoff          max(1, initial_scale / S): a backed-off global
                     scale S lowers every gradient, and the points judge
                     amax as if it had not
    telemetry_next   1 when the next `apply` call records telemetry
    due              (paper rule) 1 when it updates the scales

from the count of `apply` calls now (`scaling.schedule`: a skipped step
does not advance it, so its retry is due again).
"""

import warnings

import tensorflow as tf

from tf_als._src.model import _keras
from tf_als._src.training import arguments
from tf_als._src.training import owners
from tf_als._src.scaling import schedule as schedule_module


def before_apply(optimizer) -> tuple:
    """Before Keras's apply: (the step the gradients are applied at,
    whether it records telemetry, whether it updates the scales: always
    under the amax rule, on update steps under the paper's)."""
    telemetry_due = due(optimizer, optimizer.telemetry_interval) > 0
    updates = tf.constant(True)
    if optimizer.rule == "paper":
        updates = due(optimizer, optimizer.update_interval) > 0
    return step(optimizer), telemetry_due, updates


def receive(optimizer, variables):
    """The instrumented models that own `variables` (those
    `optimizer.apply` received; None: not known yet), each told that
    `optimizer` trains it and checked to use its knobs. `apply` calls it
    before it builds the optimizer: a refusal inside the first traced step
    after the build left the optimizer's variables unmade, and every later
    step a silent no-op (its scale read as an empty array)."""
    if variables is None:
        return None
    models = owners.owning(variables)
    for model in models:
        model.note_trainer(optimizer)
        arguments.check_same_knobs(optimizer, model)
    return models


def warn_of_the_start(optimizer, models, variables, recovery) -> None:
    """At an `apply` of `optimizer` to `variables`, which belong to the
    instrumented `models`: the warnings it gives once each
    (`warn_not_instrumented`, `warn_unchecked`), as `recovery` (the
    optimizer's `failures.recovery.Recovery`) has recorded them."""
    if not models and not recovery.warned_plain:
        recovery.warned_plain = True
        warn_not_instrumented(optimizer, variables)
    warn_unchecked(optimizer, models, recovery)


def warn_not_instrumented(optimizer, variables) -> None:
    """Warns that `optimizer` applies gradients of no instrumented model,
    unless `variables` belong to one with no scaling points (`instrument`
    said why)."""
    if owners.owning(variables, scaled=False):
        return
    warnings.warn(
        f"AdaptiveLossScaleOptimizer {optimizer.name!r} is applying "
        "gradients of a model that was not instrumented: per-layer scaling "
        "is off, and this is exactly Keras's LossScaleOptimizer. Instrument "
        "the model to turn it on: `model = tf_als.instrument(model)` before "
        "compiling (or before the custom training loop).",
        stacklevel=4,
    )


def warn_unchecked(optimizer, models, recovery) -> None:
    """Warns, once per optimizer, when its first traced step trains
    instrumented `models` without the first-batch check: a wrapper
    model's own `train_step` that `fit` runs (keras.io's DDIM, a GAN) or a
    compiled custom loop, where nothing calls `preflight`. Eager loops
    check after their first steps (`check_skips`); a resumed run (a step
    already applied) needs no check."""
    if (
        not models
        or recovery.preflown
        or recovery.warned_unchecked
        or tf.executing_eagerly()
        or not optimizer.promote_on_storm
    ):
        return
    recovery.warned_unchecked = True
    with tf.init_scope():
        if optimizer.built and int(optimizer.iterations.numpy()):
            return
    names = ", ".join(repr(m.name) for m in models)
    warnings.warn(
        f"AdaptiveLossScaleOptimizer {optimizer.name!r} starts training "
        f"{names} without the first-batch check, so its first steps may be "
        "skipped while the global scale falls from "
        f"{optimizer.initial_scale:g}, as Keras's LossScaleOptimizer's are. "
        "`fit` runs the check for the instrumented model passed to it; "
        "where another model's `train_step` trains the instrumented ones "
        "(a GAN, keras.io's DDIM) or a compiled loop does, call "
        "`optimizer.preflight(model, batches, step_loss=...)` once before "
        "training (docs/training-loops.md).",
        stacklevel=4,
    )


def step(optimizer) -> tf.Tensor:
    """The optimizer step (int64) the gradients of the `apply` call being
    made are applied (or skipped) at."""
    return tf.cast(tf.convert_to_tensor(optimizer.iterations), tf.int64)


def due(optimizer, interval: int) -> tf.Tensor:
    """1 (int64) when the `apply` call being made is due for `interval`
    (`scaling.schedule.due_at`)."""
    calls = _keras.apply_calls(optimizer.inner_optimizer)
    accumulation = int(optimizer.inner_optimizer.gradient_accumulation_steps or 1)
    return schedule_module.due_at(calls, accumulation, interval)


def backoff(optimizer) -> tf.Tensor:
    """max(1, initial global scale / current global scale)."""
    if not optimizer.built:
        return tf.constant(1.0)
    initial = tf.constant(optimizer.initial_scale, tf.float32)
    return tf.maximum(1.0, initial / tf.convert_to_tensor(optimizer.dynamic_scale))


def schedule(optimizer, model) -> None:
    """Writes what `model`'s next backward pass needs from `optimizer`."""
    state = model.scaling_state
    state.backoff.assign(backoff(optimizer))
    state.telemetry_next.assign(due(optimizer, optimizer.telemetry_interval))
    if optimizer.rule == "paper":
        state.due.assign(due(optimizer, optimizer.update_interval))
