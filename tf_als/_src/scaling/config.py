"""The per-layer scaling knobs, checked once and frozen.

`AdaptiveLossScaleOptimizer` builds a `ScalingConfig` from its arguments and
hands it to the instrumented models it trains (their backward passes choose
the scales from it) and to the telemetry schedule (`schedule`);
neither reads the optimizer's attributes.
"""

import dataclasses
import importlib.util
import math
import numbers

from tf_als._src.scaling.rule import FLOAT16_MAX_EXPONENT

# The rules that choose a point's scale (see `ScalingConfig.rule`).
RULES = ("amax", "paper")


@dataclasses.dataclass(frozen=True)
class ScalingConfig:
    """How the per-layer scales are chosen (see
    `tf_als.AdaptiveLossScaleOptimizer` for each knob's meaning).

    Attributes:
        rule: `"amax"` (the default: every step, each point's scale is
            chosen from the amax of the gradient it is applied to) or
            `"paper"` (the ALS paper's: every `update_interval` steps, the
            reciprocal of the `underflow_rate` quantile, capped by safety).
        update_interval: int >= 1, steps between the `"paper"` rule's scale
            updates.
        telemetry_interval: int >= 1, steps between telemetry records (the
            statistics `ScaleHistory`, TensorBoard and `diagnose` read).
        underflow_rate: float in [0, 1), the quantile of nonzero gradient
            magnitudes each point records.
        max_layer_scale: power of two in [1, 2**15], the ceiling of every
            per-layer scale.
        overflow_margin: power of two in [1, 2**15], the headroom kept
            below float16's maximum.

    Example:

    >>> ScalingConfig(telemetry_interval=10).max_layer_scale
    32768.0
    >>> ScalingConfig(rule="quantile")
    Traceback (most recent call last):
    ...
    ValueError: `rule` must be one of 'amax', 'paper'; received 'quantile'.
    >>> ScalingConfig(overflow_margin=3)
    Traceback (most recent call last):
    ...
    ValueError: `overflow_margin` must be a power of two from 1 to 2**15 = 32768 (powers of two keep every rescale exact, and float16 must hold the scale); received 3.
    """

    rule: str = "amax"
    update_interval: int = 100
    telemetry_interval: int = 100
    underflow_rate: float = 0.01
    max_layer_scale: float = 2.0**15
    overflow_margin: float = 2.0**12

    def __post_init__(self):
        if self.rule not in RULES:
            allowed = ", ".join(repr(r) for r in RULES)
            raise ValueError(f"`rule` must be one of {allowed}; received {self.rule!r}.")
        if self.rule == "paper" and importlib.util.find_spec("tensorflow_probability") is None:
            raise ImportError(
                "rule='paper' computes its quantile with tensorflow-probability, "
                "which is not installed: `pip install 'tf_als[paper]'` (or "
                "`tensorflow-probability` and the `tf-keras` of your "
                "TensorFlow's minor release)."
            )
        check_int("update_interval", self.update_interval)
        check_int("telemetry_interval", self.telemetry_interval)
        if (
            isinstance(self.underflow_rate, bool)
            or not isinstance(self.underflow_rate, numbers.Real)
            or not 0.0 <= self.underflow_rate < 1.0
        ):
            raise ValueError(
                "`underflow_rate` must be a float in [0, 1) (the quantile of "
                f"nonzero gradient magnitudes); received {self.underflow_rate!r}."
            )
        _check_power_of_two("max_layer_scale", self.max_layer_scale)
        _check_power_of_two("overflow_margin", self.overflow_margin)
        # Normalised types: ints and numpy scalars are accepted above.
        for name in ("update_interval", "telemetry_interval"):
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("underflow_rate", "max_layer_scale", "overflow_margin"):
            object.__setattr__(self, name, float(getattr(self, name)))


def check_int(name, value, none_allowed=False):
    """Raises ValueError unless `value` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        allowed = "an integer >= 1 or None" if none_allowed else "an integer >= 1"
        raise ValueError(f"`{name}` must be {allowed}; received {value!r}.")


def _check_power_of_two(name, value):
    limit = 2**FLOAT16_MAX_EXPONENT
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


def backward_fields(config: ScalingConfig) -> tuple:
    """The fields a backward pass is built from (the others only drive the
    optimizer's schedule)."""
    fields = (config.rule, config.max_layer_scale, config.overflow_margin)
    if config.rule == "paper":
        fields += (config.underflow_rate,)
    return fields
