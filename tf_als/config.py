"""The per-layer scaling knobs, checked once and frozen.

`AdaptiveLossScaleOptimizer` builds a `ScalingConfig` from its arguments and
hands it to the scale update (`tf_als.update`) and the measuring schedule
(`tf_als.schedule`); neither reads the optimizer's attributes.
"""

import dataclasses
import math
import numbers

from tf_als import rule


@dataclasses.dataclass(frozen=True)
class ScalingConfig:
    """How the per-layer scales are chosen (see
    `tf_als.AdaptiveLossScaleOptimizer` for each knob's meaning).

    Attributes:
        update_interval: int >= 1, steps between scale updates.
        underflow_rate: float in [0, 1), the quantile of nonzero gradient
            magnitudes each point records.
        max_layer_scale: power of two in [1, 2**15], the ceiling of every
            per-layer scale.
        overflow_margin: power of two in [1, 2**15], the headroom kept
            below float16's maximum.

    Example:

    >>> ScalingConfig(update_interval=10).max_layer_scale
    32768.0
    >>> ScalingConfig(overflow_margin=3)
    Traceback (most recent call last):
    ...
    ValueError: `overflow_margin` must be a power of two from 1 to 2**15 = 32768 (powers of two keep every rescale exact, and float16 must hold the scale); received 3.
    """

    update_interval: int = 100
    underflow_rate: float = 0.01
    max_layer_scale: float = 2.0**15
    overflow_margin: float = 2.0**12

    def __post_init__(self):
        check_int("update_interval", self.update_interval)
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
        object.__setattr__(self, "update_interval", int(self.update_interval))
        for name in ("underflow_rate", "max_layer_scale", "overflow_margin"):
            object.__setattr__(self, name, float(getattr(self, name)))


def check_int(name, value, none_allowed=False):
    """Raises ValueError unless `value` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        allowed = "an integer >= 1 or None" if none_allowed else "an integer >= 1"
        raise ValueError(f"`{name}` must be {allowed}; received {value!r}.")


def _check_power_of_two(name, value):
    limit = 2**rule.FLOAT16_MAX_EXPONENT
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
