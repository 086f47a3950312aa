"""`AdaptiveLossScaleOptimizer`: Keras's dynamic loss scaling, plus the knobs
that drive the per-layer scales of the instrumented models whose gradients
it applies."""

import difflib
import inspect
import itertools
import math
import numbers
import warnings
import weakref
from typing import Callable, Iterable

import keras
import tensorflow as tf

from tf_als._src.model import _keras
from tf_als._src.scaling import config as config_module
from tf_als._src.training import owners
from tf_als._src.failures import preflight as preflight_module
from tf_als._src.failures import promote
from tf_als._src.scaling import schedule
from tf_als._src.failures import silent
from tf_als._src.failures import storm
from tf_als._src.training import update

DEFAULT_MAX_CONSECUTIVE_SKIPS = 32
DEFAULT_INTERVAL = 100


@keras.saving.register_keras_serializable(package="tf_als")
class AdaptiveLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Dynamic loss scaling with per-layer adaptive scales (Zhao et al., 2019).

    It is a `keras.optimizers.LossScaleOptimizer` with every argument, config
    key and behaviour of it: a global loss scale S that halves (and the step
    is skipped) when a gradient is not finite and doubles after
    `dynamic_growth_steps` finite steps. On a model that was not
    instrumented it behaves exactly like its parent.

    On a model returned by `tf_als.instrument`, every call of a layer with
    weights also has its own scale s_n, applied to the gradient g that
    reaches it. On every step, inside the backward pass, each point picks
    it from that very gradient:

        amax  = max |g|
        s_n   = 2 ** clip(largest k with amax * backoff * 2**k *
                          overflow_margin <= float16 max,
                          -log2(T_out), log2(max_layer_scale))

    (1 when g is all zero or not finite), where T_out is the lift the
    gradient already carries from the points downstream (a point whose
    incoming gradient has no headroom left gives that lift back, down to
    Keras's global scale alone, and no further), and backoff = max(1,
    initial_scale / S), so that a backed-off global scale lowers every
    gradient. One max-reduction per point, no branch. Every
    `telemetry_interval` steps, `apply` also records each point's
    statistics (the `underflow_rate` percentile of the nonzero |g|,
    fractions of zero, subnormal and near-maximum elements, a log2
    histogram), estimated from a sample of g, for `ScaleHistory`,
    TensorBoard and `tf_als.diagnose`; they are reported, never decided
    on. With `rule="paper"`, the points instead take the ALS paper's
    scale, the reciprocal of that percentile (capped as above), every
    `update_interval` steps, and keep it in between. Under
    `tf.distribute`, every replica chooses from its own gradients (its
    weight gradients are unscaled before Keras sums them, so they need not
    agree); on every step the replicas also sum one scalar so that they
    skip non-finite steps together (Keras alone decides from the first
    replica's gradients). Weight gradients are unscaled per call, in
    float32, so the inner optimizer only ever receives true float32
    gradients.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer`, the optimizer that
            applies the (unscaled) gradients. Not itself a loss scale
            optimizer.
        initial_scale: float, default 2**15. Initial global loss scale S.
        dynamic_growth_steps: int, default 2000. S doubles after this many
            consecutive finite steps.
        update_interval: int >= 1, default 100. With `rule="paper"`, the
            steps between scale updates (the points re-choose on steps where
            `iterations % update_interval == 0`, the first included, and
            keep the scale in between). The default rule chooses on every
            step; there, a value other than 100 without
            `telemetry_interval` is read as the telemetry interval (what
            it also set until 0.3), with a `DeprecationWarning`. With
            `gradient_accumulation_steps` on the inner optimizer,
            `iterations` counts applied steps (`schedule`).
        underflow_rate: float in [0, 1), default 0.01. The quantile of the
            nonzero gradient magnitudes that each point records and checks
            against float16's smallest normal (the paper's 1% underflow),
            and from which `rule="paper"` chooses.
        max_layer_scale: float, power of two in [1, 2**15], default 2**15.
            Ceiling of each per-layer scale.
        overflow_margin: float, power of two in [1, 2**15], default 2**12.
            Headroom kept between a scaled gradient's maximum and float16's
            maximum, for growth inside the layer's own backward pass.
        max_consecutive_skips: int >= 1 or None, default 32. After this many
            consecutive steps skipped for non-finite gradients, training
            stops with a `storm.NonFiniteStormError` that names the
            layer whose weight gradient was first non-finite at the first
            skipped step (32 halvings take the default scale 2**15 down to
            2**-17; a healthy run needs a handful). `fit` on an instrumented
            model and eager loops check on their own; compiled custom loops
            call `check_skips()` after each step. As many skips within
            twice as many steps, not in a row, warn once instead (the run
            goes on, at a global scale that keeps halving). None never
            stops or warns, as Keras's `LossScaleOptimizer`.
        promote_on_storm: bool, default True. Find the layers whose float16
            arithmetic fails and switch them to float32, the expert's
            one-line fix (`preflight`, `promote`): on the
            first batch, before `fit`'s first step (a custom loop: its
            first `check_skips` with batches and the loss), and where the
            run would stop (`max_consecutive_skips` skips in a row), stall
            (as many skips within twice that many steps) or fall below a
            global scale of 1. The checks re-run batches eagerly: each
            float16 layer output against the layer's float32 re-run, model
            outputs against their targets and the loss, the backward pass
            at every scale. Every failing layer is promoted at once (at
            most 4 distinct failures per model), and the global scale is
            then set where the batch's gradients are finite (before the
            first step too: a model that overflows at `initial_scale`
            skips no step to find out). When nothing can be promoted,
            consecutive skips raise the storm error and frequent ones warn
            once. False: Keras's behaviour, with the storm error.
        rule: `"amax"` (default) or `"paper"`, how the points choose their
            scales (see above; `config.ScalingConfig`). The paper's
            percentile sorts each point's gradient (`tfp.stats.percentile`)
            on its update steps.
        telemetry_interval: int >= 1, default 100 (see `update_interval`
            for old configs). Steps between telemetry records.
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

    In a custom training loop or a model's own `train_step`, call
    `optimizer.scale_loss(loss)` inside the tape and `optimizer.apply(grads,
    variables)` after it, as with Keras's `LossScaleOptimizer`. The
    optimizer updates the scales of every instrumented model whose
    variables it applies: one optimizer may train several models (a VAE's
    encoder and decoder), and a step may run several optimizers (a GAN's);
    see docs/training-loops.md.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
        update_interval: int = DEFAULT_INTERVAL,
        underflow_rate: float = 0.01,
        max_layer_scale: float = 2.0**15,
        overflow_margin: float = 2.0**12,
        max_consecutive_skips: int | None = DEFAULT_MAX_CONSECUTIVE_SKIPS,
        promote_on_storm: bool = True,
        rule: str = "amax",
        telemetry_interval: int | None = None,
        name: str | None = None,
        **kwargs,
    ):
        _check_keywords(kwargs)
        _check_inner(inner_optimizer)
        _check_positive_number("initial_scale", initial_scale)
        config_module.check_int("dynamic_growth_steps", dynamic_growth_steps)
        config_module.check_int("update_interval", update_interval)
        telemetry_interval = _telemetry_interval(
            rule, update_interval, telemetry_interval
        )
        scaling_config = config_module.ScalingConfig(
            rule=rule,
            telemetry_interval=telemetry_interval,
            update_interval=update_interval,
            underflow_rate=underflow_rate,
            max_layer_scale=max_layer_scale,
            overflow_margin=overflow_margin,
        )
        if not isinstance(promote_on_storm, bool):
            raise ValueError(
                f"`promote_on_storm` must be True or False; received {promote_on_storm!r}."
            )
        if max_consecutive_skips is not None:
            config_module.check_int(
                "max_consecutive_skips", max_consecutive_skips, none_allowed=True
            )
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
        self._warned_plain = False
        self._gave_up_on_window = False  # Frequent skips: warned once.
        # Set once a loop calls check_skips with batches: an eager `apply`
        # then leaves the check (and the promotion) to the loop.
        self._loop_checks = False
        # Whether the first batch was checked (`preflight`), and whether a
        # global scale below 1 was looked into (`_promote_below_one`).
        self._preflown = False
        self._looked_below = float("inf")
        # While `apply` runs: (its gradients, their `_finite_flags`).
        self._checked = None
        # Weak references to the instrumented models whose variables the
        # latest `apply` received (for promotion and storm messages).
        self._applied_models = []

    def build(self, var_list):
        super().build(var_list)
        # Steps skipped in a row; whether the loss of the latest step was
        # finite (1, 0; -1: not recorded); and at the first skipped step of
        # the streak [index of the trainable variable closest to the loss
        # whose gradient was not finite (-1: none), how many were not
        # finite, whether the loss itself was finite].
        self.consecutive_skips = self._int_variable((), 0, "consecutive_skips")
        self.loss_finite = self._int_variable((), -1, "loss_finite")
        self.first_non_finite = self._int_variable((3,), -1, "first_non_finite")
        # Steps and skipped steps in the current window of
        # 2 * max_consecutive_skips steps (the frequent-skips trigger).
        self.window_steps = self._int_variable((), 0, "window_steps")
        self.window_skips = self._int_variable((), 0, "window_skips")

    def _int_variable(self, shape, value, name):
        return self.add_variable(
            shape=shape,
            dtype="int32",
            initializer=keras.initializers.Constant(value),
            aggregation="none",
            name=name,
        )

    def apply(self, grads, trainable_variables=None):
        self._build_once(trainable_variables)
        variables = list(trainable_variables or _keras.optimizer_variables(self))
        models = owners.owning(variables)
        self._applied_models = [weakref.ref(m) for m in models]
        self._warn_if_plain(models)
        for model in models:
            model.note_trainer(self)
            self._check_config(model)
        # Before Keras's apply: the step the gradients are applied at, and
        # whether it records telemetry and (paper rule) updates the scales.
        step, telemetry_due = self._step(), self._due(self.telemetry_interval) > 0
        updates = tf.constant(True)
        if self.rule == "paper":
            updates = self._due(self.update_interval) > 0
        own = self._divide_by_scale(list(grads), variables, models)
        # One finiteness pass per gradient, shared by the agreement between
        # replicas, Keras's check (`check_finite`) and the first-skip record.
        flags = _finite_flags(own)
        self._checked = (own, flags)
        try:
            super().apply(_agree_across_replicas(list(own), flags), trainable_variables)
        finally:
            self._checked = None
        self._record_first_skip(flags)  # This replica's own, unpoisoned.
        for model in models:
            keep = tf.logical_and(_all_true(flags), updates)
            update.write_pass(model, step, keep, telemetry_due, self.scaling_config)
            self._schedule(model)
        if tf.executing_eagerly() and not self._loop_checks:
            self.check_skips()

    def _build_once(self, trainable_variables):
        """Builds the optimizer on its first `apply`, as Keras's does."""
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True

    def _divide_by_scale(self, grads, variables, models):
        """`grads` divided by the global scale S, before Keras's finite-step
        conditional rather than inside it (`_stateful_handle_finite_grads`
        applies them as they come): a gradient the backward pass of one of
        `models` unscaled as a whole is divided in that same multiply
        (`unscaled`), any other as Keras divides it."""
        scale = self.dynamic_scale
        result = []
        for g, v in zip(grads, variables):
            if g is None or _keras.overwrites_with_gradient(self, v):
                result.append(g)
                continue
            folded = None
            for model in models:
                folded = model.unscaled_gradients.divided(g, scale)
                if folded is not None:
                    break
            result.append(keras.ops.divide(g, scale) if folded is None else folded)
        return result

    @property
    def update_interval(self) -> int:
        return self.scaling_config.update_interval

    @property
    def rule(self) -> str:
        return self.scaling_config.rule

    @property
    def telemetry_interval(self) -> int:
        return self.scaling_config.telemetry_interval

    @property
    def underflow_rate(self) -> float:
        return self.scaling_config.underflow_rate

    @property
    def max_layer_scale(self) -> float:
        return self.scaling_config.max_layer_scale

    @property
    def overflow_margin(self) -> float:
        return self.scaling_config.overflow_margin

    def _step(self):
        return tf.cast(tf.convert_to_tensor(self.iterations), tf.int64)

    def _accumulation(self) -> int:
        return int(self.inner_optimizer.gradient_accumulation_steps or 1)

    def _due(self, interval):
        """1 (int64) when the `apply` call being made is due for `interval`
        (`schedule`)."""
        calls = _keras.apply_calls(self.inner_optimizer)
        return schedule.due_at(calls, self._accumulation(), interval)

    def _schedule(self, model):
        """After Keras's apply, what `model`'s next backward pass needs from
        this optimizer: the global scale's back-off, whether it is a
        telemetry step (its forward pass then measures its outputs), and
        (paper rule) whether it updates the scales, from the count of `apply` calls now
        (a skipped step did not advance it, so its retry updates again)."""
        model.scaling_state.backoff.assign(self._backoff())
        model.scaling_state.telemetry_next.assign(self._due(self.telemetry_interval))
        if self.rule == "paper":
            model.scaling_state.due.assign(self._due(self.update_interval))

    def _check_config(self, model):
        """Raises when `model`'s backward pass chooses its scales with other
        knobs than this optimizer's (it was traced, or ran, before they
        met: a custom loop whose model was not compiled with it)."""
        mine = config_module.backward_fields(self.scaling_config)
        theirs = config_module.backward_fields(model.scaling_config)
        if mine == theirs:
            return
        raise ValueError(
            f"AdaptiveLossScaleOptimizer {self.name!r} applies gradients of "
            f"model {model.name!r}, whose backward pass chose its scales "
            f"with {_knobs(model.scaling_config)}, not this optimizer's "
            f"{_knobs(self.scaling_config)}: the pass is built before the "
            "optimizer applies it. Compile the model with the optimizer "
            "before its first step: `model.compile(optimizer=optimizer)` "
            "(in a custom loop too)."
        )

    def _backoff(self):
        """max(1, initial global scale / current global scale)."""
        if not self.built:
            return tf.constant(1.0)
        initial = tf.constant(self.initial_scale, tf.float32)
        return tf.maximum(1.0, initial / tf.convert_to_tensor(self.dynamic_scale))

    def _warn_if_plain(self, models):
        """Warns once when gradients reach this optimizer and no
        instrumented model owns any of their variables."""
        if self._warned_plain or models:
            return
        self._warned_plain = True
        warnings.warn(
            f"AdaptiveLossScaleOptimizer {self.name!r} is applying gradients "
            "of a model that was not instrumented: per-layer scaling is off, "
            "and this is exactly Keras's LossScaleOptimizer. Instrument the "
            "model to turn it on: `model = tf_als.instrument(model)` before "
            "compiling (or before the custom training loop).",
            stacklevel=3,
        )

    def check_finite(self, grads):
        """Whether every gradient is finite: Keras's check, except that a
        sparse gradient (`tf.IndexedSlices`, e.g. an `Embedding`'s) is
        judged by its values. Keras 3.15 densifies it with
        `tf.tensor_scatter_nd_update`, which keeps one row per index: when a
        token occurs twice in a batch and one of its rows is not finite,
        the check can pass and the non-finite gradient is applied, leaving
        the embedding NaN for good (seen on a KerasHub Llama with dropout
        0.1 under Keras's `LossScaleOptimizer`)."""
        checked = getattr(self, "_checked", None)
        if checked is not None and _same_tensors(checked[0], grads):
            flags = checked[1]  # Computed in `apply` for these very tensors.
        else:
            flags = _finite_flags(grads)
        return _all_true(flags)

    def _record_first_skip(self, flags):
        """After Keras's apply: if this step began a streak of skipped
        steps, records where its gradients were not finite, from `flags`
        (`_finite_flags` of this replica's own gradients)."""

        def record():
            bad = tf.logical_not(tf.stack(flags or [tf.constant(True)]))
            positions = tf.range(tf.size(bad, out_type=tf.int32))
            self.first_non_finite.assign(
                tf.stack(
                    [
                        tf.reduce_max(tf.where(bad, positions, -1)),
                        tf.reduce_sum(tf.cast(bad, tf.int32)),
                        tf.convert_to_tensor(self.loss_finite),
                    ]
                )
            )
            return tf.constant(True)

        first = tf.equal(self.consecutive_skips, 1)
        tf.cond(first, record, lambda: tf.constant(False))

    def _stateful_handle_finite_grads(self, grads, trainable_variables):
        # Keras's own, less its division by S: `apply` divided already.
        self.inner_optimizer.apply(grads, trainable_variables=trainable_variables)

        def grow():
            self.step_counter.assign(0)
            self.dynamic_scale.assign(self.dynamic_scale * 2.0)

        def count():
            self.step_counter.assign_add(1)

        keras.ops.cond(
            keras.ops.equal(self.step_counter, self.dynamic_growth_steps - 1),
            grow,
            count,
        )
        self.consecutive_skips.assign(0)
        self._count_window(skipped=0)

    def _stateful_handle_non_finite_grads(self):
        super()._stateful_handle_non_finite_grads()
        # The floor: Keras halves for good, down to exactly 0, after which
        # a finite step divides its gradients by 0.
        self.dynamic_scale.assign(
            tf.maximum(self.dynamic_scale, preflight_module.MIN_SCALE)
        )
        self.consecutive_skips.assign_add(1)
        self._count_window(skipped=1)

    def _count_window(self, skipped):
        """Counts this step, and whether it was skipped, in the current
        window of 2 * max_consecutive_skips steps (a new window starts
        once one is full)."""
        if self.max_consecutive_skips is None:
            return
        full = self.window_steps >= 2 * self.max_consecutive_skips
        self.window_skips.assign(tf.where(full, 0, self.window_skips) + skipped)
        self.window_steps.assign(tf.where(full, 0, self.window_steps) + 1)

    def check_skips(
        self,
        attempted: int | None = None,
        batches: Callable[[], Iterable] | None = None,
        loss: Callable | None = None,
    ) -> list:
        """Acts when the last `max_consecutive_skips` steps were all
        skipped, or as many steps within twice that many: promotes the
        layer whose float16 arithmetic fails to float32 (see
        `promote_on_storm`); else raises `storm.NonFiniteStormError`
        for the consecutive skips, or warns once for the frequent ones.

        `fit` on an instrumented model calls it after every batch with the
        training batches and the compiled loss (and retraces its train
        function after a promotion). An eager loop's `apply` calls it
        without batches (a storm stops with the error) until the loop
        calls it with batches itself; from then on the loop checks. Call
        it after each step of a compiled (`tf.function`) custom loop, and
        make the function again when it promoted a layer:

        ```python
        step = tf.function(train_step)
        for x, y in dataset:
            step(x, y)                # calls optimizer.apply()
            if optimizer.check_skips(batches=lambda: [(x, y)], loss=loss_fn):
                step = tf.function(train_step)   # trace the float32 layer
        ```

        Args:
            attempted: how many batches the loop has run, if known; the
                message then counts steps as the loop does (skipped ones
                included).
            batches: a callable returning an iterable of training batches
                to re-run eagerly (up to 8 of them): input batches, or,
                with `loss`, `(x, y)` or `(x, y, sample_weight)` tuples.
                Without it nothing is promoted.
            loss: `loss(y_true, y_pred)` (or with `sample_weight=`), the
                training loss; needed to re-run the backward pass when the
                loss was finite and the gradients were not.

        Returns:
            The `promote.Promotion`s this call made (usually none).
        """
        if batches is not None:
            self._loop_checks = True
        if not self.built:
            return []
        for model in self.applied_models():
            silent.warn_silent_failures(model, stacklevel=3)
        if self.max_consecutive_skips is None:
            return []
        first = self._first_check(batches, loss)
        if first:
            return first
        skips = int(keras.ops.convert_to_numpy(self.consecutive_skips))
        if skips >= self.max_consecutive_skips:
            made, why = self._promote(batches, loss)
            if made:
                return list(made)
            message = storm.describe(self, skips, attempted)
            if why is not None:
                message += f" promote_on_storm: {why}."
            raise storm.NonFiniteStormError(message)
        window = int(keras.ops.convert_to_numpy(self.window_skips))
        if window >= self.max_consecutive_skips and not self._gave_up_on_window:
            return self._promote_on_frequent_skips(window, batches, loss)
        return self._promote_below_one(skips, batches, loss)

    def _promote_below_one(self, skips, batches, loss) -> list:
        """A skip took the global scale below 1: every gradient of the model
        is now shrunk to serve one, usually a float16 model output that
        cannot carry the loss's gradient (a float16 softmax under a
        cross-entropy). Looks for such a layer (`preflight`, the
        latest batches first) and promotes it; says nothing when there is
        none (a model whose gradients are large everywhere). Looks again
        only once the scale has fallen another 2**4."""
        if skips == 0 or batches is None or loss is None:
            return []
        scale = float(keras.ops.convert_to_numpy(self.dynamic_scale))
        if scale >= min(1.0, self._looked_below / 2.0**4):
            return []
        self._looked_below = scale
        made, _ = self._promote(batches, loss)
        return list(made)

    def _first_check(self, batches, loss) -> list:
        """In a custom loop, the first `check_skips` with batches and the
        loss, on one of the first two steps, runs the preflight `fit` runs
        before its first step (`preflight`)."""
        if self._preflown or batches is None or loss is None:
            return []
        self._preflown = True
        models = self.applied_models()
        step = int(keras.ops.convert_to_numpy(self.iterations))
        if not self.promote_on_storm or len(models) != 1 or step > 1:
            return []
        made, _ = self.preflight(models[0], batches, loss, first=step == 0)
        return list(made)

    def _promote_on_frequent_skips(self, window, batches, loss):
        """Half the steps of the window skipped, not in a row (a layer that
        overflows on some batches): promote, or say once why not."""
        made, why = self._promote(batches, loss)
        if made:
            return list(made)
        self._gave_up_on_window = True
        steps = int(keras.ops.convert_to_numpy(self.window_steps))
        warnings.warn(
            f"{window} of the last {steps} training steps were skipped "
            "because their gradients were not finite; the global loss scale "
            "keeps halving and most gradients may underflow. "
            + (f"promote_on_storm: {why}. " if why else "")
            + "Run tf_als.diagnose(model, x, y) on a batch to see where.",
            stacklevel=3,
        )
        return []

    def applied_models(self) -> list:
        """The live instrumented models whose variables the latest `apply`
        received (several for a VAE's encoder and decoder)."""
        return [m for m in (r() for r in self._applied_models) if m is not None]

    def _promote(self, batches, loss):
        """(promotions made, why none or not enough) for the storm now:
        `preflight` on up to 8 of `batches`, and the global scale
        re-calibrated on them."""
        models = self.applied_models()
        if not self.promote_on_storm or not models:
            return (), None
        if len(models) > 1:
            names = ", ".join(repr(m.name) for m in models)
            return (), (
                f"this optimizer trains several instrumented models ({names}), "
                "and re-running batches needs one model from inputs to loss"
            )
        if batches is None:
            return (), "no training batches were given to re-run"
        loss_finite = int(keras.ops.convert_to_numpy(self.first_non_finite)[2])
        if loss is None and loss_finite != 0:
            return (), (
                "the loss was finite at the first skipped step, so the "
                "backward pass failed, and re-running it needs the loss "
                "(pass `loss=` and batches of `(x, y)` to check_skips)"
            )
        made, why = self.preflight(models[0], batches, loss, limit=8, first=False)
        if not made and why is None:
            why = (
                "an eager re-run of the training batches found no layer whose "
                "float16 arithmetic fails (the data may hold NaN or inf, or "
                "the failing batches or dropout draws differ), so no layer "
                "was promoted to float32"
            )
        if why is not None and made:
            return (), why + " (promoted so far: " + ", ".join(
                repr(p.layer) for p in promote.promoted(models[0])
            ) + ")"
        return made, why

    def preflight(
        self, model, batches, loss=None, limit: int = 1, first: bool = True
    ) -> tuple:
        """Runs `preflight` on up to `limit` of `batches` (a callable
        returning `(x, y[, sample_weight])` tuples, or input batches when
        `loss` is None): promotes the layers of `model` whose float16
        arithmetic fails on them, with a warning each, and sets the global
        scale to the largest power of two, at most `initial_scale`, at
        which their gradients are finite. `fit` calls it on the first batch
        before the first step (`first`: the scale is chosen even when
        nothing is promoted); a storm calls it through `check_skips`
        (`first=False`: the scale is re-calibrated only after a promotion,
        and otherwise left, with the skip record, for the storm error).

        Returns:
            (the promotions made; why a failure was left unpromoted, or
            None).
        """
        self._build_once(model.trainable_variables)
        self._preflown = True
        step = int(keras.ops.convert_to_numpy(self.iterations))
        loss_fn = None if loss is None else _loss_function(loss)
        triples = _triples_of(batches) if loss is not None else _inputs_only(batches)
        outcome = preflight_module.run(
            model,
            itertools.islice(triples(), limit),
            loss_fn,
            self.initial_scale,
            step,
            choose=first,
        )
        for promotion in outcome.promotions:
            warnings.warn(
                f"tf_als promoted layer {promotion.layer!r} to float32 at step "
                f"{promotion.step}: {promotion.reason}. Training goes on "
                "from the same step (tf_als.promoted(model) lists "
                "promotions).",
                stacklevel=4,
            )
        if outcome.promotions:
            model.forget_traces()  # The promoted layers trace in float32.
        if outcome.promotions or first:
            self._restart(model, outcome.scale)
        return outcome.promotions, outcome.stopped

    def _restart(self, model, scale):
        """Sets the global scale to `scale` (None: where it was before the
        skips) and forgets the skip counts; the next backward pass of
        `model` reads the new back-off."""
        if scale is None:
            skips = int(keras.ops.convert_to_numpy(self.consecutive_skips))
            current = float(keras.ops.convert_to_numpy(self.dynamic_scale))
            scale = min(self.initial_scale, current * 2.0**skips)
        self.dynamic_scale.assign(max(scale, preflight_module.MIN_SCALE))
        self.step_counter.assign(0)
        self.consecutive_skips.assign(0)
        self.window_steps.assign(0)
        self.window_skips.assign(0)
        self.loss_finite.assign(-1)
        self.first_non_finite.assign([-1, -1, -1])
        self._looked_below = float("inf")
        self._schedule(model)

    def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
        """Multiplies `loss` by the global scale S (and records whether the
        loss was finite, for the message of a skipped step)."""
        if self.built:
            # For the record of a skipped step: was the loss itself finite?
            finite = tf.reduce_all(
                tf.math.is_finite(tf.cast(tf.convert_to_tensor(loss), tf.float32))
            )
            self.loss_finite.assign(tf.cast(finite, tf.int32))
        return super().scale_loss(loss)

    def get_config(self):
        config = super().get_config()
        config.update(
            rule=self.rule,
            telemetry_interval=self.telemetry_interval,
            update_interval=self.update_interval,
            underflow_rate=self.underflow_rate,
            max_layer_scale=self.max_layer_scale,
            overflow_margin=self.overflow_margin,
            max_consecutive_skips=self.max_consecutive_skips,
            promote_on_storm=self.promote_on_storm,
        )
        return config


# Keyword arguments Keras's LossScaleOptimizer takes besides its named ones
# (`dynamic`, and base optimizer defaults that old configs carry).
_PARENT_KEYWORDS = (
    "dynamic",
    "weight_decay",
    "clipnorm",
    "global_clipnorm",
    "clipvalue",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)


def _telemetry_interval(rule, update_interval, telemetry_interval):
    """The telemetry interval to use. Until 0.3, `update_interval` also set
    how often the statistics were recorded; a config that sets it without
    `telemetry_interval` (an old one, or old code) keeps that cadence for
    the telemetry, with a warning when the default rule makes it moot."""
    if telemetry_interval is not None:
        return telemetry_interval
    if update_interval != DEFAULT_INTERVAL and rule == "amax":
        warnings.warn(
            f"`update_interval={update_interval!r}`: since tf_als 0.3 the "
            "per-layer scales follow the gradient on every step, and "
            "`update_interval` only sets how often the paper's rule "
            "(`rule='paper'`) updates them. It now sets "
            "`telemetry_interval`, how often the statistics are recorded; "
            "pass `telemetry_interval` instead.",
            DeprecationWarning,
            stacklevel=4,
        )
        return update_interval
    return DEFAULT_INTERVAL


def _knobs(config) -> str:
    fields = ("rule", "max_layer_scale", "overflow_margin")
    if config.rule == "paper":
        fields += ("underflow_rate",)
    return ", ".join(f"{f}={getattr(config, f)!r}" for f in fields)


def _check_keywords(kwargs):
    named = [
        p for p in inspect.signature(AdaptiveLossScaleOptimizer.__init__).parameters
        if p not in ("self", "kwargs")
    ]
    for key in kwargs:
        if key in _PARENT_KEYWORDS:
            continue
        close = difflib.get_close_matches(key, named + list(_PARENT_KEYWORDS), n=1)
        hint = f" Did you mean `{close[0]}`?" if close else ""
        # ValueError, as Keras's LossScaleOptimizer raises for these.
        raise ValueError(
            f"AdaptiveLossScaleOptimizer got an unexpected keyword argument "
            f"`{key}`.{hint} Its arguments: {', '.join(named)}."
        )


def _check_inner(inner_optimizer):
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` is already a loss scale optimizer "
            f"({type(inner_optimizer).__name__}); loss scaling would be "
            "applied twice. Pass the optimizer it wraps, e.g. "
            "`AdaptiveLossScaleOptimizer(keras.optimizers.Adam())`."
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`inner_optimizer` must be a keras.optimizers.Optimizer instance "
            f"(e.g. keras.optimizers.Adam()); received {inner_optimizer!r}."
        )


def _check_positive_number(name, value):
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"`{name}` must be a positive finite number; received {value!r}."
        )


def _all_finite(gradient) -> tf.Tensor:
    """Whether a dense or sparse (`tf.IndexedSlices`) gradient is finite."""
    if isinstance(gradient, tf.IndexedSlices):
        gradient = gradient.values
    return tf.reduce_all(tf.math.is_finite(gradient))


def _agree_across_replicas(grads, flags):
    """With several replicas in sync, makes every replica see a non-finite
    gradient when any replica has one.

    Keras 3.15 decides whether to apply a step from each replica's own
    gradients, before they are summed; under a `merge_call` strategy
    (MirroredStrategy) it takes the first replica's answer. When another
    replica's gradient is the non-finite one, the step is applied and the
    summed gradient writes inf into the weights (seen on the tiny KerasHub
    GPT-2 on two logical CPUs, `benchmarks/mirrored_gpt2.py`). Here the
    replicas sum one count of non-finite gradients (one scalar all-reduce
    per step), and a replica whose own gradients are finite while another's
    are not turns its smallest dense gradient into NaN, so that Keras's
    check skips the step everywhere. Nothing changes with one replica.
    `flags` are `_finite_flags(grads)`.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return grads
    dense = [
        i for i, g in enumerate(grads)
        if g is not None and not isinstance(g, tf.IndexedSlices)
    ]
    if not dense:
        return grads
    local_bad = tf.logical_not(_all_true(flags))
    bad = context.all_reduce(
        tf.distribute.ReduceOp.SUM, tf.cast(local_bad, tf.float32)
    ) > 0.0
    smallest = min(dense, key=lambda i: grads[i].shape.num_elements() or 0)
    gradient = grads[smallest]
    grads[smallest] = tf.where(
        bad, tf.fill(tf.shape(gradient), tf.constant(float("nan"), gradient.dtype)), gradient
    )
    return grads


def _triples_of(batches):
    """`batches` of `(x, y)` or `(x, y, sample_weight)` as triples."""
    return lambda: (
        keras.utils.unpack_x_y_sample_weight(tuple(b)) for b in batches()
    )


def _inputs_only(batches):
    """Input `batches` as `(x, None, None)` triples."""
    return lambda: ((x, None, None) for x in batches())


def _loss_function(loss):
    """`loss(y, y_pred[, sample_weight=])` as `(x, y, y_pred, sample_weight)
    -> scalar`, reduced to the batch mean as `compile` reduces a
    per-sample loss."""

    def loss_fn(x, y, y_pred, sample_weight):
        if sample_weight is None:
            value = loss(y, y_pred)
        else:
            value = loss(y, y_pred, sample_weight=sample_weight)
        return tf.reduce_mean(tf.cast(value, tf.float32))

    return loss_fn


def _finite_flags(grads) -> list:
    """Whether each gradient of `grads` is finite (True for None)."""
    return [tf.constant(True) if g is None else _all_finite(g) for g in grads]


def _all_true(flags) -> tf.Tensor:
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


def _same_tensors(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
