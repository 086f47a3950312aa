"""`AdaptiveLossScaleOptimizer`: Keras's dynamic loss scaling plus the knobs
of the per-layer scales. What it calls on lives in `arguments`, `handoff`
(to a model's next backward pass), `replicas`, `skips` and
`failures.recovery`."""

import weakref
from typing import Callable, Iterable

import keras
import tensorflow as tf

from tf_als._src.failures import recovery
from tf_als._src.model import _keras
from tf_als._src.scaling import config as config_module
from tf_als._src.scaling import rule
from tf_als._src.training import arguments
from tf_als._src.training import handoff
from tf_als._src.training import own_step
from tf_als._src.training import replicas
from tf_als._src.training import skips
from tf_als._src.training import unscaled
from tf_als._src.training import update


def _knob(name: str, doc: str) -> property:
    """A read-only attribute: the optimizer's `ScalingConfig` field `name`."""
    return property(lambda self: getattr(self.scaling_config, name), doc=doc)


def _write_back(optimizer, model, when, produced, scale) -> None:
    """Writes the pass `model` just ran into its state and schedules its
    next one: `when` is (step, whether to keep the scales, whether
    telemetry is due); `produced` and `scale` as `update.write_gains`."""
    step, keep, telemetry_due = when
    # Traced after the loss: whether it summed float16 outputs is visible.
    model.float16_output_record.warn_if_reduced(model)
    with tf.name_scope("tf_als_update"):
        update.write_pass(model, step, keep, telemetry_due, optimizer.scaling_config)
        update.write_gains(model, produced, scale)
        handoff.schedule(optimizer, model)


@keras.saving.register_keras_serializable(package="tf_als")
class AdaptiveLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Dynamic loss scaling with per-layer adaptive scales (Zhao et al., 2019).

    A `keras.optimizers.LossScaleOptimizer` with all its arguments, config
    keys and behaviour (a global scale S that halves, skipping the step,
    when a gradient is not finite and doubles after `dynamic_growth_steps`
    finite steps), kept on a model not instrumented (`check_finite` aside).
    On a model from `tf_als.instrument`, every call of a layer with weights
    also picks its own scale s_n on every step, in the backward pass, from
    the gradient g that reaches it:

        s_n = 2 ** clip(largest k with max|g| * backoff * 2**k *
                        overflow_margin <= float16 max,
                        -log2(T_out), log2(max_layer_scale))

    (1 when g is zero or not finite), T_out being the lift g carries from
    the points downstream and backoff = max(1, initial_scale / S). Every
    `telemetry_interval` steps the points record statistics of g (the
    `underflow_rate` percentile, zero, subnormal and near-maximum shares, a
    log2 histogram), reported, never decided on. `rule="paper"`: the ALS
    paper's scale instead, 1 / that percentile (capped as above), every
    `update_interval` steps. Weight gradients are unscaled per call, so the
    inner optimizer receives true float32 gradients; under `tf.distribute`
    all replicas skip the same steps.

    Args:
        inner_optimizer: a `keras.optimizers.Optimizer` (not a loss scale
            optimizer), applies the unscaled gradients.
        initial_scale: float, default 2**15. Initial global loss scale S.
        dynamic_growth_steps: int, default 2000; S doubles after as many finite steps.
        update_interval: int >= 1, default 100. `rule="paper"`: steps
            between scale updates. Under `"amax"`, another value without
            `telemetry_interval` sets that instead (a `DeprecationWarning`).
        underflow_rate: float in [0, 1), default 0.01. The quantile of the
            nonzero |g| each point records (and `"paper"` chooses from).
        max_layer_scale: power of two in [1, 2**15], default 2**15; the per-layer ceiling.
        overflow_margin: power of two in [1, 2**15], default 2**12; headroom kept
            below float16's maximum for the growth in a layer's backward pass.
        max_consecutive_skips: int >= 1 or None, default 32. This many steps
            skipped in a row raise `NonFiniteStormError`, naming the layer
            whose gradient was first non-finite; as many within twice as
            many steps warn once (`check_skips`). None: never, as Keras.
        promote_on_storm: bool, default True. On the first batch, and where
            the run would stop, stall or fall below S = 1, re-run batches
            eagerly, switch the layers whose float16 arithmetic fails to
            float32 and set S where the gradients are finite (`preflight`).
            False: Keras's behaviour, with the storm error.
        rule: `"amax"` (default) or `"paper"` (see above).
        telemetry_interval: int >= 1, default 100. Steps between records.
        name: str, optional name.

    Example:

    ```python
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = tf_als.instrument(build_model())
    model.compile(
        optimizer=tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam()),
        loss="sparse_categorical_crossentropy",
    )
    model.fit(x, y)
    tf_als.scales(model)  # {"dense": 8.0, "dense_1": 1.0, ...}
    ```

    In a custom loop: `scale_loss(loss)` in the tape, `apply(grads,
    variables)` after it, as Keras's; one optimizer may train several
    models (docs/training-loops.md).
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
        update_interval: int = arguments.DEFAULT_INTERVAL,
        underflow_rate: float = 0.01,
        max_layer_scale: float = 2.0**15,
        overflow_margin: float = 2.0**12,
        max_consecutive_skips: int | None = 32,
        promote_on_storm: bool = True,
        rule: str = "amax",
        telemetry_interval: int | None = None,
        name: str | None = None,
        **kwargs,
    ):
        arguments.check_keywords(kwargs, AdaptiveLossScaleOptimizer.__init__)
        arguments.check_inner_optimizer(inner_optimizer)
        arguments.check_positive_number("initial_scale", initial_scale)
        config_module.check_int("dynamic_growth_steps", dynamic_growth_steps)
        config_module.check_int("update_interval", update_interval)
        scaling_config = config_module.ScalingConfig(
            rule=rule,
            telemetry_interval=arguments.telemetry_interval(
                rule, update_interval, telemetry_interval
            ),
            update_interval=update_interval,
            underflow_rate=underflow_rate,
            max_layer_scale=max_layer_scale,
            overflow_margin=overflow_margin,
        )
        arguments.check_skip_knobs(max_consecutive_skips, promote_on_storm)
        super().__init__(
            inner_optimizer,
            initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps,
            name=name,
            **kwargs,
        )
        self.scaling_config = scaling_config
        self.max_consecutive_skips = (
            None if max_consecutive_skips is None else int(max_consecutive_skips)
        )
        self.promote_on_storm = promote_on_storm
        self._recovery = recovery.Recovery()
        self._checked = None  # While `apply` runs: (gradients, their flags).
        self._applied_models = []  # Weak references (`applied_models`).

    rule = _knob("rule", "How the points choose their scales.")
    update_interval = _knob("update_interval", "Steps between paper-rule updates.")
    telemetry_interval = _knob("telemetry_interval", "Steps between records.")
    underflow_rate = _knob("underflow_rate", "The quantile each point records.")
    max_layer_scale = _knob("max_layer_scale", "Ceiling of a per-layer scale.")
    overflow_margin = _knob("overflow_margin", "Headroom below float16's max.")

    def build(self, var_list):
        super().build(var_list)
        skips.add_counters(self)

    def apply(self, grads, trainable_variables=None):
        own_step.intercept(self)  # Never applies during that check.
        models = handoff.receive(self, trainable_variables)  # Before building.
        self._build_once(trainable_variables)
        variables = list(trainable_variables or _keras.optimizer_variables(self))
        models = handoff.receive(self, variables) if models is None else models
        self._applied_models = [weakref.ref(m) for m in models]
        handoff.warn_of_the_start(self, models, variables, self._recovery)
        step, telemetry_due, updates = handoff.before_apply(self)
        scale = tf.convert_to_tensor(self.dynamic_scale)  # This step's S.
        # Divided by S before Keras's finite-step conditional, which
        # applies them as they come (`_stateful_handle_finite_grads`).
        own = unscaled.divide_by_scale(self, list(grads), variables, models, scale)
        # One read per gradient, its amax: for the points' gains, and the
        # finiteness flags of replicas, `check_finite` and skip records.
        amaxes = replicas.amaxes(own)
        flags = replicas.flags_of(amaxes)
        self._checked = (own, flags)
        try:
            super().apply(replicas.agree(list(own), flags), trainable_variables)
        finally:
            self._checked = None
        skips.record_first_skip(self, flags)  # This replica's own, unpoisoned.
        # By the gradient as the backward pass handed it over (`unscaled`).
        produced = {id(g): a for g, a in zip(grads, amaxes) if g is not None}
        keep = tf.logical_and(replicas.all_true(flags), updates)
        for model in models:
            _write_back(self, model, (step, keep, telemetry_due), produced, scale)
        if tf.executing_eagerly() and not self._recovery.loop_checks:
            self.check_skips()

    def _build_once(self, trainable_variables):
        """Builds the optimizer on its first `apply`, as Keras's does."""
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True

    def check_finite(self, grads):
        """Keras's check; a sparse gradient is judged by its values."""
        checked = getattr(self, "_checked", None)
        return replicas.all_true(replicas.flags_for(grads, checked))

    # The two overrides mirror Keras 3.15.1's `LossScaleOptimizer`
    # (keras/src/optimizers/loss_scale_optimizer.py): the finite branch
    # less its division by S (`apply` divided already), and both plus the
    # skip counters; the non-finite branch also floors S.
    def _stateful_handle_finite_grads(self, grads, trainable_variables):
        self.inner_optimizer.apply(grads, trainable_variables=trainable_variables)
        grow = keras.ops.equal(self.step_counter, self.dynamic_growth_steps - 1)
        self.step_counter.assign(keras.ops.where(grow, 0, self.step_counter + 1))
        self.dynamic_scale.assign(
            keras.ops.where(grow, self.dynamic_scale * 2.0, self.dynamic_scale)
        )
        skips.finite_step(self)

    def _stateful_handle_non_finite_grads(self):
        super()._stateful_handle_non_finite_grads()
        self.dynamic_scale.assign(tf.maximum(self.dynamic_scale, rule.MIN_SCALE))
        skips.skipped_step(self)

    def check_skips(
        self,
        attempted: int | None = None,
        batches: Callable[[], Iterable] | None = None,
        loss: Callable | None = None,
        step_loss: Callable | None = None,
    ) -> list:
        """Acts on skipped steps (`max_consecutive_skips` in a row, as many
        within twice as many steps, or S below 1): promotes the layers
        whose float16 arithmetic fails to float32 (`promote_on_storm`);
        else raises `NonFiniteStormError`, or warns once. `fit` and eager
        `apply` call it; a compiled custom loop, after each step:

        ```python
        step = tf.function(train_step)
        for x, y in dataset:
            step(x, y)                # calls optimizer.apply()
            if optimizer.check_skips(batches=lambda: [(x, y)], loss=loss_fn):
                step = tf.function(train_step)   # trace the float32 layer
        ```

        Args:
            attempted: how many batches the loop has run, if known.
            batches: a callable returning up to 8 training batches to re-run
                (inputs; with `loss`, `(x, y[, sample_weight])`); None
                promotes nothing.
            loss: `loss(y_true, y_pred[, sample_weight=])`, the loss.
            step_loss: instead of `loss`, for a step whose loss is not a
                function of one model's outputs (a GAN's): `step_loss(batch)`,
                the unscaled loss the step differentiates for this
                optimizer's model, computed from one of `batches` as the
                step computes it (see `preflight`).

        Returns the `Promotion`s made (usually none).
        """
        loss = recovery.user_loss(loss, step_loss)
        return self._recovery.check(self, attempted, batches, loss)

    def applied_models(self) -> list:
        """The live instrumented models the latest `apply` trained."""
        return [m for m in (r() for r in self._applied_models) if m is not None]

    def preflight(
        self,
        model: keras.Model,
        batches: Callable[[], Iterable],
        loss: Callable | None = None,
        limit: int = 1,
        first: bool = True,
        step_loss: Callable | None = None,
    ) -> tuple:
        """The first-batch check: promotes the layers of `model` whose
        float16 arithmetic fails on up to `limit` of `batches`, with a
        warning each, and sets S to the largest power of two, at most
        `initial_scale`, at which their gradients are finite (`first`: even
        when nothing was promoted), with each scaling point's first scale
        bounded by what it will produce. `fit` runs it on its first batch
        for Keras's own train step; a model's own `train_step` (a GAN) or
        a custom loop calls it once, before its first step, with the loss
        its step differentiates:

        ```python
        batch = next(iter(dataset))
        gan.d_optimizer.preflight(
            gan.critic, lambda: [batch],
            step_loss=lambda b: gan.critic_loss(b["real"], b["z1"]))
        gan.g_optimizer.preflight(
            gan.generator, lambda: [batch],
            step_loss=lambda b: gan.generator_loss(b["z2"]))
        gan.fit(dataset)
        ```

        The check is eager, leaves every variable as it found it, and runs
        the plain forward pass of every instrumented model the loss calls.

        Args:
            model: the instrumented model this optimizer trains.
            batches: a callable returning training batches: with `loss`,
                `(x, y[, sample_weight])` tuples; with `step_loss`, the
                step's own batches; with neither, inputs (the forward pass
                only).
            loss: `loss(y_true, y_pred[, sample_weight=])`, a loss of
                `model`'s outputs (reduced to the batch mean).
            limit, first: how many of `batches` to check; whether to
                choose S even when nothing was promoted.
            step_loss: instead of `loss`, `step_loss(batch)`: the unscaled
                scalar loss the step differentiates for `model`'s weights,
                computed from one batch by calling the models, as the step
                does (a gradient penalty's inner tape included).

        Returns (the promotions made, why a failure was left unpromoted or
        None).
        """
        loss = recovery.user_loss(loss, step_loss)
        self._build_once(model.trainable_variables)
        return self._recovery.preflight(self, model, batches, loss, limit, first)

    def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
        """`loss` times S (whether it was finite is kept for messages)."""
        own_step.intercept(self, loss)  # The check of a model's own step.
        if self.built:
            skips.record_loss(self, loss)
        return super().scale_loss(loss)

    def get_config(self):
        config = super().get_config()
        config.update({key: getattr(self, key) for key in _CONFIG_KEYS})
        return config


# The keys the subclass adds to its parent's config.
_CONFIG_KEYS = (
    "rule", "telemetry_interval", "update_interval", "underflow_rate",
    "max_layer_scale", "overflow_margin", "max_consecutive_skips", "promote_on_storm",
)
