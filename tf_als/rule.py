"""From gradient statistics to a per-layer scale: the whole rule, pure.

This is the only module that knows float16's limits and the percentile rule.
Everything here is a function of tensors with no variables and no Keras, so it
is tested on crafted tensors without `fit()`.

The rule, for the gradient `g` that arrives at a scaling point (already
carrying the global scale S and the downstream per-layer scales):

    q     = underflow_rate-quantile of the nonzero |g|, rounded down to a
            power of two (exact for the test below; from exponent counts)
    amax  = max |g| * max(1, S_initial / S)
    k_cap = largest k with  amax * 2**k * overflow_margin <= FLOAT16_MAX
    s     = 2 ** clip(k_cap, -log2(T_out), log2(max_layer_scale))
    s     = previous s   if g is all zero or not finite
    underflow reported   if q * s < FLOAT16_MIN_NORMAL

amax is judged as if the global scale S had not backed off below its initial
value. Otherwise a per-layer scale would undo every back-off (a lower S
lowers amax, so the lift rises to match): a gradient that grows past float16's
range further upstream, where no per-layer scale can lower it, would then
overflow at every S, and S would slide to zero. With the back-off factor,
halving S halves the gradients everywhere, as with Keras's loss scaling.

The scale aims as high as safety allows rather than at the smallest scale that
lifts q: underflow also happens inside a layer's own backward pass, where q
cannot see it, and the margin below float16's maximum is what keeps that
backward pass (and the layers above it) from overflowing.

A scale below 1 gives back lift. The gradient reaching a point already
carries T_out, the lift chosen by the points downstream of it, from their
own gradients. Gradients often grow on the way back (a post-LN residual
stream grows through every LayerNormalization), so a lift that was safe
where it was chosen can leave no headroom further up, and a point that could
only keep or raise it would overflow there: a skipped step and a halved
global scale, where Keras's single scale would not have skipped. Such a
point takes s < 1, as far as T_in = s * T_out = 1 and no further: the
gradient is then scaled exactly as Keras's global scale alone would scale
it, never less.

Every statistic is a linear pass over the gradient (reductions and one
count per binary exponent); nothing is sorted, so an update step's cost
grows with the gradient's size, not with size * log(size). The exponent
counts give both the percentile and the log2 histogram.
"""

from typing import NamedTuple

import tensorflow as tf

from tf_als import _pow2

FLOAT16_MAX = 65504.0
FLOAT16_MAX_EXPONENT = 15  # 2**15 is the largest power of two below the max.
FLOAT16_MIN_NORMAL = 2.0**-14
FLOAT16_MIN_SUBNORMAL = 2.0**-24
# "Near overflow": within a factor of two of the largest float16.
FLOAT16_NEAR_MAX = FLOAT16_MAX / 2.0
# Histogram of log2 magnitudes: one bin per binary exponent a float16 can
# hold, from its smallest subnormal, 2**-24, to 2**15 (smaller or larger
# float32 values land in the end bins).
HISTOGRAM_EXPONENTS = tuple(range(-24, FLOAT16_MAX_EXPONENT + 1))


class GradientStatistics(NamedTuple):
    """What a scaling point measures of its incoming gradient.

    All fields are float32 scalars, in the units of the gradient as it
    arrived (that is, including every scale applied downstream of it).

    Attributes:
        percentile: the `underflow_rate` quantile of the nonzero magnitudes
            (lower interpolation) rounded down to a power of two, or 0 when
            every element is zero.
        amax: the largest magnitude (inf if any element is inf, NaN if any
            is NaN). Float32 subnormals (below 2**-126) read as zero on
            TensorFlow's CPU kernels, so such a gradient counts as all zero.
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


def gradient_statistics(gradients, underflow_rate) -> GradientStatistics:
    """Measures a gradient (or several, pooled) in float32.

    Args:
        gradients: a tensor or a list of tensors of any float dtype; their
            elements are pooled.
        underflow_rate: float in [0, 1) (or a scalar tensor). Which quantile
            of the nonzero magnitudes to report as `percentile`.

    Returns:
        A `GradientStatistics`.

    Example:

    >>> g = tf.constant([0.0, 1.0, 2.0, 3.0, 4.0], tf.float16)
    >>> s = gradient_statistics(g, underflow_rate=0.5)
    >>> float(s.percentile), float(s.amax), round(float(s.zero_fraction), 6)
    (2.0, 4.0, 0.2)
    """
    magnitudes = _pooled_magnitudes(gradients)
    statistics, _ = _statistics_of_magnitudes(magnitudes, _as_float64(underflow_rate))
    return GradientStatistics(*statistics)


def _statistics_of_magnitudes(magnitudes, underflow_rate):
    """The `GradientStatistics` fields and the `log2_histogram` of a flat
    float32 tensor of magnitudes, in linear passes: no sort."""
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
    amax = nan_max(magnitudes)
    counts = _exponent_counts(magnitudes, is_zero)
    percentile = _percentile(counts, nonzero, underflow_rate)
    size = tf.maximum(size, 1.0)
    statistics = (percentile, amax, zeros / size, subnormal / size, near_max / size)
    return statistics, _histogram(counts, size)


# Exponent bins: one per float32 binary exponent, _LOWEST to _HIGHEST (TF's
# CPU kernels flush float32 subnormals to zero), then one for non-finite
# magnitudes, which rank above every finite one.
_LOWEST, _HIGHEST = _pow2.MIN_EXPONENT, _pow2.MAX_EXPONENT
_NON_FINITE_BIN = _HIGHEST - _LOWEST + 1


def nan_max(values, axis=None) -> tf.Tensor:
    """The maximum of `values` (float32) over `axis`, NaN wherever a NaN is
    among them: TensorFlow's max reduction may drop NaN. inf stays inf.

    >>> float(nan_max(tf.constant([1.0, float("nan"), 3.0])))
    nan
    >>> nan_max(tf.constant([[1.0, 2.0], [float("inf"), 0.0]]), 0).numpy()
    array([inf,  2.], dtype=float32)
    """
    return tf.where(
        tf.reduce_any(tf.math.is_nan(values), axis),
        tf.constant(float("nan")),
        tf.reduce_max(values, axis),
    )


def _exponent_counts(magnitudes, is_zero):
    """int32 counts of the nonzero magnitudes per binary exponent bin."""
    finite = tf.math.is_finite(magnitudes)
    exponents = _pow2.floor_log2(
        tf.maximum(tf.where(finite, magnitudes, 1.0), 2.0**_LOWEST)
    )
    bins = tf.where(finite, exponents - _LOWEST, _NON_FINITE_BIN)
    return tf.math.unsorted_segment_sum(
        tf.cast(tf.logical_not(is_zero), tf.int32), bins, _NON_FINITE_BIN + 1
    )


def _percentile(counts, nonzero, underflow_rate):
    """The `underflow_rate` quantile of the nonzero magnitudes (lower
    interpolation), rounded down to a power of two: the lower edge of the
    exponent bin that holds the element of rank floor(rate * (nonzero-1))
    (the relative 2**-40 absorbs float64's rounding of a decimal rate,
    0.29 * 100 = 28.999999999999996, and moves no rank that is genuinely
    below an integer by more than that). Rounding down keeps every
    comparison with a power of two exact: q * s >= 2**-14 holds for the
    rounded q exactly when it holds for q. inf when that element is not
    finite; 0 when every element is zero."""
    rank = tf.floor(
        underflow_rate
        * tf.maximum(tf.cast(nonzero, tf.float64) - 1.0, 0.0)
        * (1.0 + 2.0**-40)
    )
    below = tf.cast(tf.math.cumsum(counts), tf.float64) <= rank
    bin_ = tf.reduce_sum(tf.cast(below, tf.int32))
    percentile = tf.where(
        bin_ >= _NON_FINITE_BIN, tf.constant(float("inf")), _pow2.pow2(bin_ + _LOWEST)
    )
    return tf.where(nonzero > 0, percentile, 0.0)


def _histogram(counts, size):
    """`log2_histogram` from exponent counts: the fraction of all elements
    per exponent in `HISTOGRAM_EXPONENTS`, the end bins taking the float32
    exponents beyond them; zeros and non-finite elements in no bin."""
    low = HISTOGRAM_EXPONENTS[0] - _LOWEST
    high = HISTOGRAM_EXPONENTS[-1] - _LOWEST
    bins = tf.concat(
        [
            tf.reduce_sum(counts[: low + 1])[tf.newaxis],
            counts[low + 1 : high],
            tf.reduce_sum(counts[high:_NON_FINITE_BIN])[tf.newaxis],
        ],
        0,
    )
    return tf.cast(bins, tf.float32) / size


def choose_scale(
    statistics: GradientStatistics,
    current_scale,
    max_layer_scale,
    overflow_margin,
    backoff=1.0,
    inherited=1.0,
) -> tf.Tensor:
    """Returns the new per-layer scale (float32, a power of two).

    Args:
        statistics: `GradientStatistics` of the incoming gradient.
        current_scale: float32 scalar, the scale in use; kept when the
            gradient is all zero or not finite.
        max_layer_scale: float (or float32 scalar tensor), a power of two in
            [1, 2**15]; the ceiling.
        overflow_margin: float (or float32 scalar tensor), a power of two
            >= 1; the headroom kept between the scaled gradient's amax and
            float16's maximum.
        backoff: float32 scalar >= 1, how far the global loss scale has
            backed off below its initial value (initial / current, or 1).
            amax is judged as if that back-off had not happened, so that a
            per-layer scale never undoes it: when gradients overflow
            somewhere, halving the global scale halves them everywhere.
        inherited: float32 scalar, a power of two >= 1: T_out, the lift the
            gradient already carries from the points downstream. The scale
            goes no lower than 1 / inherited, so that T_in >= 1.

    Example (amax 2**-10, margin 2**12: the cap is 2**(15 + 10 - 12)):

    >>> stats = gradient_statistics(tf.constant([2.0**-10]), 0.01)
    >>> float(choose_scale(stats, 1.0, 2.0**15, 2.0**12))
    8192.0

    An amax of 2**4 allows k = -1; inherited lift 2**6 lets the point give
    that much back, and no inherited lift keeps 1:

    >>> stats = gradient_statistics(tf.constant([16.0]), 0.01)
    >>> float(choose_scale(stats, 1.0, 2.0**15, 2.0**12, inherited=64.0))
    0.5
    >>> float(choose_scale(stats, 1.0, 2.0**15, 2.0**12))
    1.0
    """
    return choose_scale_from_amax(
        statistics.amax, current_scale, max_layer_scale, overflow_margin,
        backoff, inherited,
    )


def choose_scale_from_amax(
    amax, current_scale, max_layer_scale, overflow_margin, backoff=1.0, inherited=1.0
) -> tf.Tensor:
    """`choose_scale` from the one statistic it reads, the incoming
    gradient's amax (elementwise: any shape).

    >>> float(choose_scale_from_amax(tf.constant(2.0**-10), 1.0, 2.0**15, 2.0**12))
    8192.0
    """
    max_exponent = _pow2.floor_log2(tf.cast(max_layer_scale, tf.float32))
    min_exponent = -_pow2.floor_log2(tf.cast(inherited, tf.float32))
    exponent = tf.clip_by_value(
        safe_exponent(amax, overflow_margin, backoff), min_exponent, max_exponent
    )
    return tf.where(
        usable_amax(amax, backoff),
        _pow2.pow2(exponent),
        tf.cast(current_scale, tf.float32),
    )


def safe_exponent(amax, overflow_margin, backoff=1.0) -> tf.Tensor:
    """The largest k (int32) with amax * backoff * overflow_margin * 2**k
    <= float16's maximum: the scale exponent that safety allows, before the
    clip to [1 / inherited, max_layer_scale] (elementwise).

    The gradient times a power of two 2**f allows exactly k - f (the test
    against float16's maximum reads the mantissa, which 2**f keeps), so the
    scale update computes k once per point and walks in exponents.

    >>> int(safe_exponent(tf.constant(2.0**-10), 2.0**12))
    13
    """
    amax = tf.cast(amax, tf.float32) * tf.cast(backoff, tf.float32)
    margin = tf.cast(overflow_margin, tf.float32)
    # amax * margin >= 2**-126 keeps floor_log2 exact (a float32 gradient can
    # be smaller than any float16); such a gradient gets the ceiling anyway.
    reach = tf.maximum(amax * margin, 2.0**-126)
    cap = FLOAT16_MAX_EXPONENT - _pow2.floor_log2(reach)
    # amax * margin * 2**cap < 2**16, but may still exceed 65504.
    too_big = reach * _pow2.pow2(cap) > FLOAT16_MAX
    return cap - tf.cast(too_big, tf.int32)


def usable_amax(amax, backoff=1.0) -> tf.Tensor:
    """Whether an amax can choose a scale: positive and finite (an all-zero
    or non-finite gradient keeps its point's scale)."""
    amax = tf.cast(amax, tf.float32) * tf.cast(backoff, tf.float32)
    return tf.logical_and(amax > 0.0, tf.math.is_finite(amax))


def lifts_percentile(statistics: GradientStatistics, scale) -> tf.Tensor:
    """True when `scale` lifts the measured percentile to a normal float16
    (or when there is nothing to lift); False reports residual underflow."""
    scaled = statistics.percentile * tf.cast(scale, tf.float32)
    return tf.logical_or(
        statistics.percentile <= 0.0, scaled >= FLOAT16_MIN_NORMAL
    )


def log2_histogram(gradients) -> tf.Tensor:
    """Fraction of all elements of `gradients` (pooled) whose magnitude has
    each binary exponent in `HISTOGRAM_EXPONENTS`: bin i counts the nonzero
    finite magnitudes in [2**e, 2**(e+1)), e = HISTOGRAM_EXPONENTS[i]; the
    end bins also take the (float32) magnitudes beyond them. Zeros and
    non-finite elements are in no bin.

    >>> log2_histogram(tf.constant([0.0, 1.0, 1.5, 2.0**-20], tf.float16)).numpy()[
    ...     [4, 24]]
    array([0.25, 0.5 ], dtype=float32)
    """
    magnitudes = _pooled_magnitudes(gradients)
    size = tf.maximum(tf.cast(tf.size(magnitudes), tf.float32), 1.0)
    return _histogram(_exponent_counts(magnitudes, tf.equal(magnitudes, 0.0)), size)


# Layout of the vector `measure` returns: the `GradientStatistics` fields,
# then the `log2_histogram` bins. Replicas take the maximum of the first
# two entries and the mean of the rest (all fractions).
MEASUREMENT_SIZE = len(GradientStatistics._fields) + len(HISTOGRAM_EXPONENTS)
MAXIMUM_ENTRIES = 2


def measure(gradients, underflow_rate) -> tf.Tensor:
    """`gradient_statistics` and `log2_histogram` of `gradients` (float
    tensors of any shape, pooled) as one float32 vector of
    `MEASUREMENT_SIZE`; `split_measurement` takes it apart.

    Runs out of line: one function per combination of gradient dtypes,
    traced once per process and called by every scaling point, so a model
    with a hundred scaling points holds one copy of these ops instead of a
    hundred (tracing and graph optimisation time stay close to the plain
    model's). Scaling points call it only on update steps.
    """
    gradients = [tf.reshape(g, [-1]) for g in gradients]
    key = tuple(g.dtype for g in gradients)
    function = _MEASURE_FUNCTIONS.get(key)
    if function is None:
        function = _measure.get_concrete_function(
            [tf.TensorSpec([None], dtype) for dtype in key],
            tf.TensorSpec([], tf.float64),
        )
        _MEASURE_FUNCTIONS[key] = function
    return function(gradients, _as_float64(underflow_rate))


def split_measurement(measurement):
    """`(GradientStatistics, histogram)` from a `measure` vector."""
    fields = len(GradientStatistics._fields)
    return (
        GradientStatistics(*tf.unstack(measurement[:fields])),
        measurement[fields:],
    )


def shift_measurement(measurement, factor) -> tf.Tensor:
    """The `measure` vector the same gradient would give multiplied by
    `factor`, a power of two (a float32 scalar): what a point's incoming
    gradient becomes when the scales downstream of it change by `factor`.

    The percentile and amax are multiplied by `factor` (exact) and the
    histogram moves by log2(factor) bins (the end bins keep what moves past
    them). The subnormal and near-max fractions are read again from the
    moved histogram (the near-max one from its top bin, 2**15 and above),
    except that a gradient that is not finite keeps its near-max fraction,
    which counts the non-finite elements no bin holds (such a measurement
    keeps the point's scale anyway); the zero fraction stays. With `factor`
    1 the vector comes back unchanged.

    >>> m = measure([tf.constant([2.0**-16, 1.0, 0.0], tf.float16)], 0.0)
    >>> shifted = shift_measurement(m, tf.constant(4.0))
    >>> [float(v) for v in shifted[:4]]
    [6.103515625e-05, 4.0, 0.3333333432674408, 0.0]
    """
    return shift_measurements(measurement[tf.newaxis], tf.reshape(factor, [1]))[0]


def shift_measurements(measurements, factors) -> tf.Tensor:
    """`shift_measurement` of every row of `measurements` ([points,
    MEASUREMENT_SIZE]) by its entry of `factors` ([points]), in one pass
    over all rows: an update shifts every point's measurement at once."""
    factors = tf.cast(factors, tf.float32)
    fields = len(GradientStatistics._fields)
    statistics = measurements[:, :fields]
    histograms = measurements[:, fields:]
    bins = len(HISTOGRAM_EXPONENTS)
    rows = tf.shape(measurements)[0]
    moved_to = tf.clip_by_value(
        tf.range(bins)[tf.newaxis] + _pow2.floor_log2(factors)[:, tf.newaxis],
        0,
        bins - 1,
    )
    # One segment sum over all rows: row r's bins are segments r * bins + i.
    segments = moved_to + (tf.range(rows) * bins)[:, tf.newaxis]
    moved = tf.reshape(
        tf.math.unsorted_segment_sum(
            tf.reshape(histograms, [-1]), tf.reshape(segments, [-1]), rows * bins
        ),
        [rows, bins],
    )
    subnormal = tf.reduce_sum(moved[:, : HISTOGRAM_EXPONENTS.index(-14)], 1)
    column = GradientStatistics._fields.index
    amax = statistics[:, column("amax")]
    near_max = tf.where(
        tf.math.is_finite(amax),
        moved[:, -1],
        statistics[:, column("near_max_fraction")],
    )
    shifted = tf.concat(
        [
            tf.stack(
                [
                    statistics[:, column("percentile")] * factors,
                    amax * factors,
                    statistics[:, column("zero_fraction")],
                    subnormal,
                    near_max,
                ],
                1,
            ),
            moved,
        ],
        1,
    )
    return tf.where(tf.equal(factors, 1.0)[:, tf.newaxis], measurements, shifted)


_MEASURE_FUNCTIONS = {}


@tf.function(autograph=False, experimental_attributes={"_noinline": True})
def _measure(gradients, underflow_rate):
    magnitudes = _pooled_magnitudes(gradients)
    statistics, histogram = _statistics_of_magnitudes(magnitudes, underflow_rate)
    return tf.concat([tf.stack(statistics), histogram], 0)


def _pooled_magnitudes(gradients):
    """|g| of every element of `gradients` (a tensor or a list of them, any
    shapes), in float32, as one flat vector."""
    if not isinstance(gradients, (list, tuple)):
        gradients = [gradients]
    magnitudes = [tf.reshape(tf.abs(tf.cast(g, tf.float32)), [-1]) for g in gradients]
    return magnitudes[0] if len(magnitudes) == 1 else tf.concat(magnitudes, 0)


def _as_float64(value):
    """A Python float goes to float64 directly (0.01 must not pass through
    float32 on the way); a tensor is cast."""
    if tf.is_tensor(value):
        return tf.cast(value, tf.float64)
    return tf.constant(value, tf.float64)
