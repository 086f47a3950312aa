"""`AdaptiveLossScaleOptimizer`: Keras's dynamic loss scaling, plus the knobs
and the link that drive per-layer scales in an instrumented model."""

import math
import numbers

import keras
import tensorflow as tf

from tf_als import link
from tf_als import policy


@keras.saving.register_keras_serializable(package="tf_als")
class AdaptiveLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Dynamic loss scaling with per-layer adaptive scales (Zhao et al., 2019).

    It is a `keras.optimizers.LossScaleOptimizer` with every argument, config
    key and behaviour of it: a global loss scale S that halves (and the step
    is skipped) when a gradient is not finite and doubles after
    `dynamic_growth_steps` finite steps. On a model that was not
    instrumented it behaves exactly like its parent.

    On a model returned by `tf_als.instrument`, every call of a layer with
    weights also has its own scale s_n, applied to the gradient that reaches
    it. Every `update_interval` steps, while gradients flow, each point
    measures its incoming gradient g and picks

        amax  = max |g|
        s_n   = 2 ** clip(largest k with amax * 2**k * overflow_margin
                          <= float16 max, 0, log2(max_layer_scale))

    (kept when g is all zero or not finite), and records the
    `underflow_rate` percentile q of the nonzero |g| (tfp.stats.percentile)
    so callbacks can report layers whose q the scale could not lift. Weight
    gradients are unscaled per call, in float32, so the inner optimizer only
    ever receives true float32 gradients.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer`, the optimizer that
            applies the (unscaled) gradients. Not itself a loss scale
            optimizer.
        initial_scale: float, default 2**15. Initial global loss scale S.
        dynamic_growth_steps: int, default 2000. S doubles after this many
            consecutive finite steps.
        update_interval: int >= 1, default 100. Per-layer scales are
            re-chosen on steps where `iterations % update_interval == 0`
            (the first step included); in between they are constants and no
            statistics are computed.
        underflow_rate: float in [0, 1), default 0.01. The quantile of the
            nonzero gradient magnitudes that each point records and checks
            against float16's smallest normal (the paper's 1% underflow).
        max_layer_scale: float, power of two in [1, 2**15], default 2**15.
            Ceiling of each per-layer scale.
        overflow_margin: float, power of two in [1, 2**15], default 2**12.
            Headroom kept between a scaled gradient's maximum and float16's
            maximum, for growth inside the layer's own backward pass.
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

    In a custom training loop, call `optimizer.scale_loss(loss)` inside the
    tape (as with Keras's `LossScaleOptimizer`); that call links the
    optimizer to the instrumented model being differentiated.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
        update_interval: int = 100,
        underflow_rate: float = 0.01,
        max_layer_scale: float = 2.0**15,
        overflow_margin: float = 2.0**12,
        name: str | None = None,
        **kwargs,
    ):
        _check_inner(inner_optimizer)
        _check_positive_number("initial_scale", initial_scale)
        _check_int("dynamic_growth_steps", dynamic_growth_steps)
        _check_int("update_interval", update_interval)
        if (
            isinstance(underflow_rate, bool)
            or not isinstance(underflow_rate, numbers.Real)
            or not 0.0 <= underflow_rate < 1.0
        ):
            raise ValueError(
                "`underflow_rate` must be a float in [0, 1) (the quantile of "
                f"nonzero gradient magnitudes); received {underflow_rate!r}."
            )
        _check_power_of_two("max_layer_scale", max_layer_scale)
        _check_power_of_two("overflow_margin", overflow_margin)
        super().__init__(
            inner_optimizer,
            initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps,
            name=name,
            **kwargs,
        )
        self.update_interval = int(update_interval)
        self.underflow_rate = float(underflow_rate)
        self.max_layer_scale = float(max_layer_scale)
        self.overflow_margin = float(overflow_margin)

    def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
        """Multiplies `loss` by the global scale S, and announces this
        optimizer to the instrumented model whose gradients come next."""
        link.announce(self)
        return super().scale_loss(loss)

    def get_config(self):
        config = super().get_config()
        config.update(
            update_interval=self.update_interval,
            underflow_rate=self.underflow_rate,
            max_layer_scale=self.max_layer_scale,
            overflow_margin=self.overflow_margin,
        )
        return config


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


def _check_int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1; received {value!r}.")


def _check_power_of_two(name, value):
    limit = 2 ** policy.FLOAT16_MAX_EXPONENT
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 1 <= value <= limit
        or math.log2(value) != int(math.log2(value))
    ):
        raise ValueError(
            f"`{name}` must be a power of two from 1 to 2**15 = {limit} "
            "(powers of two keep every rescale exact, and float16 must hold "
            f"the scale); received {value!r}."
        )
