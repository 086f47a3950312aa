"""A whole model's scaling at one update, summarised: the numbers behind the
epoch logs and TensorBoard's overview cards, which stay few however many
scaling points the model has.

Pure functions of what `ScaleHistory` records (numpy only, no Keras).
"""

import numpy as np

from tf_als._src.scaling import rule

WORST_COUNT = 3
"""How many layers the overview names for underflow and for overflow."""

# A short viridis-like colour ramp (dark blue -> green -> yellow) for the
# heat map image, interpolated linearly; no matplotlib needed.
_RAMP = np.array(
    [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]],
    np.float64,
)


def subnormal_after_scale(histogram, scale: float) -> float:
    """The fraction of a point's incoming gradient elements that stay below
    float16's smallest normal (2**-14) after the point multiplies them by
    `scale`: they reach the layer's backward pass with reduced precision,
    the step before they underflow to zero. Exact zeros (from ReLU,
    padding, pooling, masks) are not counted: nothing was lost there.

    Args:
        histogram: the point's `log2_histogram` fractions, one per
            exponent in `rule.HISTOGRAM_EXPONENTS`.
        scale: the point's scale s_n (a power of two).

    >>> h = np.zeros(len(rule.HISTOGRAM_EXPONENTS))
    >>> h[[0, 10, 30]] = 0.25      # elements at 2**-24, 2**-14, 2**6
    >>> subnormal_after_scale(h, 1.0), subnormal_after_scale(h, 2.0**10)
    (0.25, 0.0)
    """
    shift = int(np.round(np.log2(scale)))
    exponents = np.asarray(rule.HISTOGRAM_EXPONENTS) + shift
    below = exponents < np.log2(rule.FLOAT16_MIN_NORMAL)
    return float(np.sum(np.asarray(histogram, np.float64)[below]))


def worst(values: dict, count: int = WORST_COUNT) -> list:
    """The `count` entries of `{name: value}` with the largest values
    (ties in name order), largest first, as `(name, value)` pairs; zeros
    are left out.

    >>> worst({"a": 0.1, "b": 0.0, "c": 0.3, "d": 0.2}, 2)
    [('c', 0.3), ('d', 0.2)]
    """
    ranked = sorted(values.items(), key=lambda item: (-item[1], item[0]))
    return [(name, value) for name, value in ranked[:count] if value > 0]


def heat_map(log2_scales, cell: int = 4, low: float = -15.0, high: float = 15.0):
    """An RGB image (uint8, [points * cell, updates * cell, 3]) of log2
    per-layer scales, rows = points in order, columns = updates: dark blue
    at `low`, yellow at `high`, grey where a value is missing (NaN).

    >>> heat_map(np.array([[0.0, 15.0]]), cell=1).shape
    (1, 2, 3)
    """
    values = np.asarray(log2_scales, np.float64)
    position = np.clip((values - low) / (high - low), 0.0, 1.0) * (len(_RAMP) - 1)
    position = np.nan_to_num(position)
    lower = np.floor(position).astype(int).clip(0, len(_RAMP) - 2)
    weight = (position - lower)[..., None]
    colours = _RAMP[lower] * (1 - weight) + _RAMP[lower + 1] * weight
    colours[np.isnan(values)] = 128.0
    image = np.repeat(np.repeat(colours, cell, axis=0), cell, axis=1)
    return image.round().astype(np.uint8)
