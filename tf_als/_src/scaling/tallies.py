"""The telemetry of a scaling point: a tally of its gradient's binary
exponents, and the statistics read from it (`GradientStatistics`, the log2
histograms).

Every statistic is a linear pass over the gradient (reductions and one
count per binary exponent); nothing is sorted, so a telemetry step's cost
grows with the sample's size, not with size * log(size) (the paper's rule,
`rule.choose_scale_paper`, sorts). The exponent counts give both the
percentile and the log2 histogram.
"""

from typing import NamedTuple

import tensorflow as tf

from tf_als._src.scaling import _pow2
from tf_als._src.scaling import rule

# Histogram of log2 magnitudes: one bin per binary exponent a float16 can
# hold, from its smallest subnormal, 2**-24, to 2**15 (smaller or larger
# float32 values land in the end bins).
HISTOGRAM_EXPONENTS = tuple(range(-24, rule.FLOAT16_MAX_EXPONENT + 1))


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
            2**15, float16's largest power of two (within a factor of two of
            its maximum), non-finite elements included.
    """

    percentile: tf.Tensor
    amax: tf.Tensor
    zero_fraction: tf.Tensor
    subnormal_fraction: tf.Tensor
    near_max_fraction: tf.Tensor


# -- tallies: the telemetry of a scaling point's sample ----------------------
#
# A tally is a gradient's amax followed by how many of its elements have
# each float32 exponent field, read from the bit pattern of |g| as float32:
# field 0 holds the zeros (and float32 subnormals, which TensorFlow's CPU
# kernels read as zero), fields 1 to 254 the binary exponents -126 to 127,
# field 255 the non-finite elements. Scales are powers of two, so the
# exponent is all the rule needs: every statistic, for any underflow rate,
# and the statistics of the same gradient times any power of two, come from
# the tally without touching the gradient again.
_EXPONENT_FIELDS = 256
_NON_FINITE_FIELD = _EXPONENT_FIELDS - 1
TALLY_SIZE = 1 + _EXPONENT_FIELDS


def _field(exponent):
    """The exponent field of binary exponent `exponent` (a normal float32)."""
    return exponent - _pow2.MIN_EXPONENT + 1


def tallies(groups) -> tf.Tensor:
    """The tally of each of `groups` (each a tensor or a list of tensors of
    any float dtype and shape, pooled), as the rows of a float32
    [len(groups), `TALLY_SIZE`]: the group's amax (NaN when one element
    is NaN; 0 for an empty group) then one count per float32 exponent
    field.

    What a telemetry step runs on every point's sample at once: a few
    elementwise ops over all of them together and one segment sum and
    one segment max keyed by group, whatever the number of groups.
    `statistics_of_tallies` derives everything else from the rows.
    Counts are exact up to 2**24 elements per exponent (float32).

    >>> t = tallies([tf.constant([0.0, -1.5, 2.0**-20, 1.0], tf.float16)])[0]
    >>> float(t[0]), float(t[1]), float(t[1 + _field(0)]), float(t[1 + _field(-20)])
    (1.5, 1.0, 2.0, 1.0)
    >>> tallies([tf.constant([1.0, -float("nan"), float("inf")]), []])[:, 0].numpy()
    array([nan,  0.], dtype=float32)
    """
    count = len(groups)
    by_dtype = {}  # dtype -> [(flat piece, its group, its size)]
    for group, gradients in enumerate(groups):
        if not isinstance(gradients, (list, tuple)):
            gradients = [gradients]
        for g in gradients:
            flat = g if g.shape.rank == 1 else tf.reshape(g, [-1])  # A sample is flat.
            size = flat.shape[0]
            by_dtype.setdefault(flat.dtype, []).append(
                (flat, group, size if size is not None else tf.size(flat))
            )
    if not by_dtype:
        return tf.zeros([count, TALLY_SIZE])
    # One concatenation and one cast per dtype, not per piece.
    values = tf.concat([
        tf.cast(tf.concat([flat for flat, _, _ in same], 0), tf.float32)
        for same in by_dtype.values()
    ], 0)
    ordered = [piece for same in by_dtype.values() for piece in same]  # As `values`.
    owners = [group for _, group, _ in ordered]
    lengths = [size for _, _, size in ordered]
    # Non-negative floats order as their bit patterns, and NaN's lie above
    # inf's: one integer max is a NaN-propagating amax.
    bits = tf.bitcast(tf.abs(values), tf.int32)
    owner = tf.repeat(tf.constant(owners, tf.int32), tf.stack(lengths))
    amax = tf.bitcast(
        tf.maximum(tf.math.unsorted_segment_max(bits, owner, count), 0), tf.float32
    )
    fields = tf.bitwise.right_shift(bits, 23)
    counts = tf.math.unsorted_segment_sum(
        tf.ones_like(fields), owner * _EXPONENT_FIELDS + fields,
        count * _EXPONENT_FIELDS,
    )
    counts = tf.reshape(tf.cast(counts, tf.float32), [count, _EXPONENT_FIELDS])
    return tf.concat([amax[:, tf.newaxis], counts], 1)


# Telemetry tallies a sample of at most this many elements of each
# incoming gradient on every step (see `sample`).
SAMPLE_SIZE = 4096


def sample(gradient, size: int = SAMPLE_SIZE, examples: int = 4) -> tf.Tensor:
    """At most about `size` elements of `gradient`, flattened: every k-th
    element, k odd and the smallest that keeps the sample within `size`
    (an odd stride walks through every channel of a power-of-two channel
    dimension instead of sampling one). The whole gradient when it has at
    most `size` elements. When only the batch dimension is unknown (a
    `fit` step), the sample strides through the first `examples` examples,
    so that the stride is a constant; a tensor of unknown shape otherwise
    is strided as a whole.

    >>> sample(tf.range(10.0), size=4).numpy()
    array([0., 3., 6., 9.], dtype=float32)
    """
    shape = gradient.shape
    if not shape.is_fully_defined() and shape.rank and shape[1:].is_fully_defined():
        count = examples * shape[1:].num_elements()
        gradient = gradient[:examples]
    else:
        count = shape.num_elements() if shape.is_fully_defined() else None
    flat = tf.reshape(gradient, [-1])
    if count is None:
        count = tf.size(flat)
    stride = (count + size - 1) // size
    stride = stride + 1 - stride % 2  # odd
    return flat[::stride]


def telemetry_tallies(samples, amaxes) -> tf.Tensor:
    """The `tallies` of every point's `sample`s ([points, `TALLY_SIZE`]),
    each row with the point's exact amax (`amaxes`, [points]) in place of
    its sample's: what a telemetry step records. `samples` holds one
    sequence of sampled gradients per point. Its counts describe the
    samples: fractions and the percentile are estimates from up to
    `SAMPLE_SIZE` elements per gradient; amax is exact.

    >>> t = telemetry_tallies([[tf.constant([0.0, 1.0, 2.0])], []], tf.constant([2.0, 0.0]))
    >>> t[:, 0].numpy().tolist(), tf.reduce_sum(t[:, 1:], axis=1).numpy().tolist()
    ([2.0, 0.0], [3.0, 0.0])
    """
    amaxes = tf.reshape(tf.cast(amaxes, tf.float32), [len(samples), 1])
    return tf.concat([amaxes, tallies([list(s) for s in samples])[:, 1:]], 1)


def statistics_of_tallies(tallies, underflow_rate) -> tuple:
    """`(GradientStatistics, histograms)` of every row of `tallies`
    ([points, TALLY_SIZE]): each field of the statistics a [points] tensor,
    the log2 histograms [points, len(HISTOGRAM_EXPONENTS)]. One pass over
    the rows, no sort: the percentile is the lower edge of the exponent bin
    that holds the element of rank floor(rate * (nonzero - 1)).

    >>> t = tallies([tf.constant([0.0, 1.0, 2.0, 3.0, 4.0])])[0]
    >>> stats, _ = statistics_of_tallies(tf.stack([t, t * 0.0]), 0.5)
    >>> stats.percentile.numpy(), stats.zero_fraction.numpy()
    (array([2., 0.], dtype=float32), array([0.2, 0. ], dtype=float32))
    """
    tallies = tf.convert_to_tensor(tallies, tf.float32)
    counts = tallies[:, 1:]
    size = tf.reduce_sum(counts, 1)
    zeros = counts[:, 0]
    nonzero = size - zeros
    subnormal = tf.reduce_sum(counts[:, 1 : _field(-14)], 1)
    near_max = tf.reduce_sum(counts[:, _field(rule.FLOAT16_MAX_EXPONENT) :], 1)
    percentile = _percentile(counts[:, 1:], nonzero, rule.as_float64(underflow_rate))
    size = tf.maximum(size, 1.0)
    statistics = GradientStatistics(
        percentile, tallies[:, 0], zeros / size, subnormal / size, near_max / size
    )
    return statistics, _histograms(counts, size)


def _percentile(counts, nonzero, underflow_rate):
    """The `underflow_rate` quantile of each row's nonzero magnitudes
    (lower interpolation), rounded down to a power of two, from `counts`
    ([points, fields 1..255]): the lower edge of the exponent bin that holds
    the element of rank floor(rate * (nonzero-1)) (the relative 2**-40
    absorbs float64's rounding of a decimal rate, 0.29 * 100 =
    28.999999999999996, and moves no rank that is genuinely below an
    integer by more than that). Rounding down keeps every comparison with a
    power of two exact: q * s >= 2**-14 holds for the rounded q exactly when
    it holds for q. inf when that element is not finite; 0 when every
    element is zero."""
    rank = tf.floor(
        underflow_rate
        * tf.maximum(tf.cast(nonzero, tf.float64) - 1.0, 0.0)
        * (1.0 + 2.0**-40)
    )
    below = tf.math.cumsum(tf.cast(counts, tf.float64), axis=1) <= rank[:, tf.newaxis]
    bin_ = tf.reduce_sum(tf.cast(below, tf.int32), 1)
    percentile = tf.where(
        bin_ >= _NON_FINITE_FIELD - 1,
        tf.constant(float("inf")),
        _pow2.pow2(bin_ + _pow2.MIN_EXPONENT),
    )
    return tf.where(nonzero > 0, percentile, 0.0)


def _histograms(counts, size):
    """Log2 histograms from exponent-field counts ([points, 256]): the
    fraction of all elements per exponent in `HISTOGRAM_EXPONENTS`, the end
    bins taking the float32 exponents beyond them; zeros and non-finite
    elements in no bin."""
    low = _field(HISTOGRAM_EXPONENTS[0])
    high = _field(HISTOGRAM_EXPONENTS[-1])
    bins = tf.concat(
        [
            tf.reduce_sum(counts[:, 1 : low + 1], 1, keepdims=True),
            counts[:, low + 1 : high],
            tf.reduce_sum(counts[:, high:_NON_FINITE_FIELD], 1, keepdims=True),
        ],
        1,
    )
    return bins / size[:, tf.newaxis]
