"""From gradient statistics to a per-layer scale: the whole rule, pure.

This is the only module that knows float16's limits and the percentile rule.
Everything here is a function of tensors with no variables and no Keras, so it
is tested on crafted tensors without `fit()`.

The rule, for the gradient `g` that arrives at a scaling point (already
carrying the global scale S and the downstream per-layer scales):

    q     = underflow_rate-quantile of the nonzero |g|    (tfp.stats.percentile)
    amax  = max |g|
    k_cap = largest k with  amax * 2**k * overflow_margin <= FLOAT16_MAX
    s     = 2 ** clip(k_cap, 0, log2(max_layer_scale))
    s     = previous s   if g is all zero or not finite
    underflow reported   if q * s < FLOAT16_MIN_NORMAL

The scale aims as high as safety allows rather than at the smallest scale that
lifts q: underflow also happens inside a layer's own backward pass, where q
cannot see it, and the margin below float16's maximum is what keeps that
backward pass (and the layers above it) from overflowing.
"""

import math
from typing import NamedTuple

import tensorflow as tf
import tensorflow_probability as tfp

from tf_als import _pow2

FLOAT16_MAX = 65504.0
FLOAT16_MAX_EXPONENT = 15  # 2**15 is the largest power of two below the max.
FLOAT16_MIN_NORMAL = 2.0**-14
FLOAT16_MIN_SUBNORMAL = 2.0**-24
# "Near overflow": within a factor of two of the largest float16.
FLOAT16_NEAR_MAX = FLOAT16_MAX / 2.0


class GradientStatistics(NamedTuple):
    """What a scaling point measures of its incoming gradient.

    All fields are float32 scalars, in the units of the gradient as it
    arrived (that is, including every scale applied downstream of it).

    Attributes:
        percentile: the `underflow_rate` quantile of the nonzero magnitudes
            (lower interpolation), or 0 when every element is zero.
        amax: the largest magnitude (inf if any element is inf, NaN if any
            is NaN).
        zero_fraction: fraction of elements that are exactly zero.
        subnormal_fraction: fraction of elements that are nonzero and below
            float16's smallest normal, 2**-14.
        near_max_fraction: fraction of elements whose magnitude is at least
            half of float16's maximum (non-finite elements included).
    """

    percentile: tf.Tensor
    amax: tf.Tensor
    zero_fraction: tf.Tensor
    subnormal_fraction: tf.Tensor
    near_max_fraction: tf.Tensor


def gradient_statistics(gradients, underflow_rate):
    """Measures a gradient (or several, pooled) in float32.

    Args:
        gradients: a tensor or a list of tensors of any float dtype; their
            elements are pooled.
        underflow_rate: float in [0, 1). Which quantile of the nonzero
            magnitudes to report as `percentile`.

    Returns:
        A `GradientStatistics`.

    Example:

    >>> g = tf.constant([0.0, 1.0, 2.0, 3.0, 4.0], tf.float16)
    >>> s = gradient_statistics(g, underflow_rate=0.5)
    >>> float(s.percentile), float(s.amax), float(s.zero_fraction)
    (2.0, 4.0, 0.2)
    """
    if not isinstance(gradients, (list, tuple)):
        gradients = [gradients]
    magnitudes = tf.concat(
        [tf.reshape(tf.abs(tf.cast(g, tf.float32)), [-1]) for g in gradients],
        axis=0,
    )
    size = tf.cast(tf.size(magnitudes), tf.float32)
    is_zero = tf.equal(magnitudes, 0.0)
    zeros = tf.reduce_sum(tf.cast(is_zero, tf.float32))
    nonzero = size - zeros
    subnormal = tf.reduce_sum(
        tf.cast(
            tf.logical_and(
                tf.logical_not(is_zero), magnitudes < FLOAT16_MIN_NORMAL
            ),
            tf.float32,
        )
    )
    # `>=` is False for NaN: count non-finite elements explicitly.
    near_max = tf.reduce_sum(
        tf.cast(
            tf.logical_or(
                magnitudes >= FLOAT16_NEAR_MAX,
                tf.logical_not(tf.math.is_finite(magnitudes)),
            ),
            tf.float32,
        )
    )
    # Propagates NaN (tf.reduce_max would drop it on some kernels).
    amax = tf.reduce_max(magnitudes) + tf.reduce_sum(magnitudes * 0.0)

    # Percentile of the nonzero magnitudes without a dynamically sized
    # boolean mask (which XLA cannot compile): zeros become +inf and sort
    # last, and the percentile is rescaled so that its index,
    # floor(q/100 * (size-1)), lands on floor(rate * (nonzero-1)). The 1e-6
    # guards against float64 rounding just below an exact integer index.
    masked = tf.where(is_zero, tf.constant(float("inf")), magnitudes)
    size64 = tf.cast(size, tf.float64)
    nonzero64 = tf.cast(nonzero, tf.float64)
    index = float(underflow_rate) * tf.maximum(nonzero64 - 1.0, 0.0) + 1e-6
    q = tf.minimum(100.0 * index / tf.maximum(size64 - 1.0, 1.0), 100.0)
    percentile = tfp.stats.percentile(masked, q, interpolation="lower")
    percentile = tf.where(nonzero > 0, percentile, 0.0)

    size = tf.maximum(size, 1.0)
    return GradientStatistics(
        percentile=percentile,
        amax=amax,
        zero_fraction=zeros / size,
        subnormal_fraction=subnormal / size,
        near_max_fraction=near_max / size,
    )


def choose_scale(statistics, current_scale, max_layer_scale, overflow_margin):
    """Returns the new per-layer scale (float32, a power of two).

    Args:
        statistics: `GradientStatistics` of the incoming gradient.
        current_scale: float32 scalar, the scale in use; kept when the
            gradient is all zero or not finite.
        max_layer_scale: float, a power of two in [1, 2**15]; the ceiling.
        overflow_margin: float, a power of two >= 1; the headroom kept
            between the scaled gradient's amax and float16's maximum.

    Example (amax 2**-10, margin 2**12: the cap is 2**(15 + 10 - 12)):

    >>> stats = gradient_statistics(tf.constant([2.0**-10]), 0.01)
    >>> float(choose_scale(stats, 1.0, 2.0**15, 2.0**12))
    8192.0
    """
    amax = statistics.amax
    max_exponent = int(round(_log2_exact(max_layer_scale, "max_layer_scale")))
    margin = tf.constant(float(overflow_margin), tf.float32)
    _log2_exact(overflow_margin, "overflow_margin")
    # amax * margin >= 2**-126 keeps floor_log2 exact (a float32 gradient can
    # be smaller than any float16); such a gradient gets the ceiling anyway.
    reach = tf.maximum(amax * margin, 2.0**-126)
    cap = FLOAT16_MAX_EXPONENT - _pow2.floor_log2(reach)
    # amax * margin * 2**cap < 2**16, but may still exceed 65504.
    too_big = reach * _pow2.pow2(cap) > FLOAT16_MAX
    cap = cap - tf.cast(too_big, tf.int32)
    exponent = tf.clip_by_value(cap, 0, max_exponent)
    usable = tf.logical_and(amax > 0.0, tf.math.is_finite(amax))
    return tf.where(
        usable, _pow2.pow2(exponent), tf.cast(current_scale, tf.float32)
    )


def lifts_percentile(statistics, scale):
    """True when `scale` lifts the measured percentile to a normal float16
    (or when there is nothing to lift); False reports residual underflow."""
    scaled = statistics.percentile * tf.cast(scale, tf.float32)
    return tf.logical_or(
        statistics.percentile <= 0.0, scaled >= FLOAT16_MIN_NORMAL
    )


def _log2_exact(value, name):
    """log2 of a positive power of two given as a Python number."""
    if not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(
            f"`{name}` must be a positive power of two; received {value!r}."
        )
    exponent = math.log2(value)
    if exponent != int(exponent):
        raise ValueError(
            f"`{name}` must be a power of two (for example {2 ** round(exponent)}); "
            f"received {value!r}."
        )
    return exponent
