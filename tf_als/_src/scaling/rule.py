"""From gradient statistics to a per-layer scale: the whole rule, pure.

This is the only module that knows float16's limits and the percentile rule.
Everything here is a function of tensors with no variables and no Keras, so it
is tested on crafted tensors without `fit()`.

The rule, for the gradient `g` that arrives at a scaling point (already
carrying the global scale S and the downstream per-layer scales T_out),
on every step, inside the point's gradient function:

    amax  = max |g|                                     (`amax_of`)
    limit = FLOAT16_MAX / (overflow_margin * max(1, S_initial / S))
                                                        (`headroom`, once per pass)
    s     = largest power of two with amax * s <= limit, clipped to
            [1 / T_out, max_layer_scale]; 1 if g is all zero or NaN
                                                        (`scale_within`)

These three functions are what the backward pass calls
(`tf_als/_src/training/choice.py`, `Choice.scale`; the last with
every point's limit converted to bits at once) and what the tests of
`tests/scaling/test_rule.py` exercise. The paper's rule
(`choose_scale_paper`, every `update_interval` steps) aims at the
`underflow_rate`-quantile q of the nonzero |g| instead, under the same cap.
Underflow is reported (on telemetry steps, from a sample of g) as the share
of g left below FLOAT16_MIN_NORMAL after s.

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

What a point records on telemetry steps, a tally of its gradient's
exponents, is `tallies`'s.
"""

import math
import struct
import types

import tensorflow as tf

from tf_als._src.scaling import _pow2

FLOAT16_MAX = 65504.0
FLOAT16_MAX_EXPONENT = 15  # 2**15 is the largest power of two below the max.
FLOAT16_MIN_NORMAL = 2.0**-14
FLOAT16_MIN_SUBNORMAL = 2.0**-24
# The smallest global scale S: the optimizer's floor (Keras halves for
# good, down to exactly 0, after which a finite step divides its gradients
# by 0), and the lowest the first-batch check tries.
MIN_SCALE = 2.0**-24


def headroom(overflow_margin, backoff=1.0) -> tf.Tensor:
    """The largest scaled amax the rule allows: float16's maximum divided
    by the margin and the back-off, in float32 (exact when both are powers
    of two, as the back-off is unless `initial_scale` is not). One per
    backward pass: every point of the pass shares it.

    >>> float(headroom(2.0**12, 2.0))
    7.99609375
    """
    factor = tf.cast(overflow_margin, tf.float32) * tf.cast(backoff, tf.float32)
    return FLOAT16_MAX / factor


def scale_within(amax, limit, max_layer_scale, inherited=1.0) -> tf.Tensor:
    """The largest power of two s with amax * s <= `limit`, clipped to
    [1 / inherited, max_layer_scale]; 1 where amax is 0 or NaN (float32,
    elementwise; `limit` 0 or a normal float32, `max_layer_scale` a power
    of two). A handful of integer and scalar ops, exact, no division: for
    positive normal float32s, a bit pattern is (exponent + 127) * 2**23
    plus the mantissa's bits, so the difference of limit's and amax's,
    rounded down to a multiple of 2**23, is floor(log2(limit / amax))
    times 2**23 (the mantissas decide the borrow); clipped to
    [-log2(inherited), log2(max_layer_scale)] before it becomes a float,
    so no exponent leaves float32's range. A float32 amax below the
    smallest normal (no float16 has one) reads as larger than it is, so
    its s can only be smaller: it is clipped to the ceiling all the same.

    >>> float(scale_within(tf.constant(3.0), tf.constant(16.0), 2.0**15))
    4.0
    >>> float(scale_within(tf.constant(3.0), tf.constant(16.0), 2.0**15, 64.0))
    4.0
    >>> float(scale_within(tf.constant(2.0**10), tf.constant(1.0), 2.0**15, 64.0))
    0.015625

    `limit` may also be given as its bit pattern (int32, `bits_of`): a
    backward pass converts every point's limit at once, not each its own.

    >>> float(scale_within(tf.constant(3.0), bits_of(16.0), 2.0**15))
    4.0
    """
    if tf.is_tensor(limit) and limit.dtype == tf.int32:
        limit_bits = limit  # A pass's limits, converted at once.
    else:
        limit_bits = bits_of(limit)
    amax = tf.cast(amax, tf.float32)
    borrow = limit_bits - tf.bitcast(amax, tf.int32)  # Discarded where amax <= 0.
    exponent = tf.bitwise.bitwise_and(borrow, -(1 << 23))  # k * 2**23.
    exponent = tf.minimum(exponent, _exponent_bits(max_layer_scale))
    # At least 1 / inherited, clipped here too: in a traced graph a float
    # 1 / x becomes a reciprocal, approximate on a CPU for 8 or more
    # elements (1 / 2**-8 came out 255.99998).
    exponent = tf.maximum(exponent, _exponent_bits(inherited, negated=True))
    scale = tf.bitcast(exponent + (127 << 23), tf.float32)
    return tf.where(amax > 0.0, scale, 1.0)


def bits_of(values) -> tf.Tensor:
    """The bit patterns of float32 `values` (int32): limits as
    `scale_within` takes them from a backward pass, which converts every
    point's at once.

    >>> int(bits_of(1.0)) == 127 << 23
    True
    """
    return tf.bitcast(tf.cast(values, tf.float32), tf.int32)


def _exponent_bits(power_of_two, negated=False):
    """log2(`power_of_two`) * 2**23 (int32), or its negation: a Python
    number's as a constant, a tensor's from its bit pattern (one
    subtraction either way).

    >>> _exponent_bits(2.0**15) == 15 << 23, _exponent_bits(0.25, negated=True) == 2 << 23
    (True, True)
    """
    if isinstance(power_of_two, (int, float)):
        bits = (math.frexp(power_of_two)[1] - 1) << 23
        return -bits if negated else bits
    bits = tf.bitcast(tf.cast(power_of_two, tf.float32), tf.int32)
    return (127 << 23) - bits if negated else bits - (127 << 23)


# A point's weight gradients are sums its own backward pass makes (a
# convolution's bias gradient sums the received gradient over batch x
# positions), so they can overflow float16 where the received gradient
# keeps its margin. Once a point has measured how much larger they came out
# (its gain, `produced_headroom`), its scale keeps them this far below float16's
# maximum: room for the gain to grow from one step to the next.
PRODUCED_MARGIN = 2.0**3
# A point's gain moves with the batch (a bias gradient's sum depends on how
# many of its terms share a sign): on a U-Net at 256 px it fell 2**3 in one
# step and rose 2**4 in the next. The gain a point keeps is the largest of
# its latest measurement and its kept gain times this factor, a peak that
# fades by half a step (`held_gain`).
GAIN_DECAY = 0.5


def produced_headroom(limit, gains, overflow_margin) -> tf.Tensor:
    """Each point's `limit` (`headroom`, the largest scaled amax of the
    gradient it receives) lowered so that the weight gradients it
    produces, `gains` times the received gradient's amax (in true units,
    measured on its last steps), stay `PRODUCED_MARGIN` below float16's
    maximum, as the received gradient stays `overflow_margin` below it:
    limit / max(1, gain * PRODUCED_MARGIN / overflow_margin), for every
    point at once ([points]), once per pass; a point then takes its own
    row (`scale_within`). With the default margin, 2**12, a gain starts
    to count above 2**9.

    A gain of 0 (not measured yet) leaves the limit as it is; inf (a weight
    gradient was not finite while the received one was) makes it 0, and
    the point takes the lowest scale it may, 1 / T_out (the global scale
    alone, as Keras's).

    >>> produced_headroom(16.0, tf.constant([0.0, 2.0**8, 2.0**15, float("inf")]), 2.0**12).numpy()
    array([16.  , 16.  ,  0.25,  0.  ], dtype=float32)
    """
    factor = tf.cast(gains, tf.float32) * (
        PRODUCED_MARGIN / tf.cast(overflow_margin, tf.float32)
    )
    limits = tf.cast(limit, tf.float32) / tf.maximum(factor, 1.0)
    # Below float32's smallest normal as 0, as `scale_within` reads it (no
    # float16 gradient's amax times a scale >= 2**-102 fits below it).
    return tf.where(limits >= 2.0**-126, limits, 0.0)


def held_gain(measured, kept) -> tf.Tensor:
    """The gain a point keeps after a step that measured `measured`, having
    kept `kept`: the larger of the measurement and the kept gain times
    `GAIN_DECAY`. A kept inf (a weight gradient overflowed) is replaced by
    the measurement: the point's scale fell back to 1 / T_out, and what it
    measures there is finite again.

    >>> held_gain(tf.constant([4.0, 1.0, 3.0]), tf.constant([2.0, 16.0, float("inf")])).numpy()
    array([4., 8., 3.], dtype=float32)
    """
    kept = tf.cast(kept, tf.float32)
    faded = tf.where(tf.math.is_inf(kept), 0.0, kept * GAIN_DECAY)
    return tf.maximum(tf.cast(measured, tf.float32), faded)


def amax_of(gradients) -> tf.Tensor:
    """The largest magnitude among `gradients` (a tensor or a list of them,
    any float dtype), as a float32 scalar: the one number the default rule
    reads, and what a scaling point computes on every step. A non-finite
    element gives inf or NaN (which keeps nothing: the step is skipped).

    >>> float(amax_of([tf.constant([1.0, -3.0], tf.float16), tf.constant([2.0])]))
    3.0
    """
    if not isinstance(gradients, (list, tuple)):
        gradients = [gradients]
    values = [_amax(g) for g in gradients]
    return values[0] if len(values) == 1 else tf.reduce_max(tf.stack(values))


def amaxes_of(tensors) -> list:
    """The amax of each of `tensors` (any float dtype; None gives 0), as
    float32 scalars, each read once: `_amax`'s integer maximum per tensor,
    then the maxima of each dtype converted to floats together (one stack,
    bitcast and unstack per dtype instead of a bitcast per tensor). What
    the optimizer computes on every step, for every gradient.

    >>> x = tf.constant([1.0, -float("inf")])
    >>> [float(a) for a in amaxes_of([tf.constant([-3.0, 2.0]), None, x])]
    [3.0, 0.0, inf]
    """
    values = [tf.constant(0.0) if t is None else None for t in tensors]
    groups = {}  # dtype -> [(position, integer maximum)]
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if t.dtype not in _BITS:
            values[i] = _amax(t)
            continue
        groups.setdefault(t.dtype, []).append((i, _largest_bits(t)))
    for dtype, members in groups.items():
        stacked = tf.stack([bits for _, bits in members])
        floats = amax_from_reduction(stacked, dtype)
        for (i, _), value in zip(members, tf.unstack(floats)):
            values[i] = value
    return values


# Forward headroom: a float16 output whose magnitude reaches float16's
# maximum divided by this factor (65504 / 16 = 4094) is "near the maximum":
# growth by that factor, or a float16 sum over that many of its elements,
# can reach inf. What a point's telemetry counts (`forward_tallies`) and
# `silent` warns about.
NEAR_MAX_FACTOR = 2**4
NEAR_MAX_THRESHOLD = FLOAT16_MAX / NEAR_MAX_FACTOR


def forward_tallies(outputs) -> tuple:
    """The forward headroom of a scaling point's float16 `outputs` (a
    list, pooled), as `(largest, near, size)`, int scalars: the largest
    magnitude's bit pattern (int16, sign cleared; below 0 when nothing was
    read), the count of elements with magnitude >= `NEAR_MAX_THRESHOLD`
    (NaN and inf counted, as in `GradientStatistics`' `near_max_fraction`)
    and the count of elements (int64). A full pass over each output, read
    from the bit patterns: a float16's magnitude orders as its bits
    without the sign, NaN's above inf's, so one mask, one maximum and one
    comparison give both. The step computes these per point, as soon as
    the point has run; `headroom_of_tallies` turns every point's into
    [amax, near-max fraction] at once, on telemetry steps only.

    >>> y = tf.constant([1.0, -5000.0, 4094.0, 100.0], tf.float16)
    >>> largest, near, size = forward_tallies([y])
    >>> int(largest) == _float16_bits(5000.0), int(near), int(size)
    (True, 2, 4)
    """
    if not outputs:
        return tf.constant(-1, tf.int16), tf.constant(0, tf.int64), tf.constant(0, tf.int64)
    threshold = _float16_bits(NEAR_MAX_THRESHOLD)
    largest, near, size = [], [], []
    for y in outputs:
        count = y.shape.num_elements()
        size.append(
            tf.size(y, out_type=tf.int64) if count is None
            else tf.constant(count, tf.int64)
        )
        bits = tf.bitwise.bitwise_and(tf.bitcast(y, tf.int16), 0x7FFF)
        largest.append(tf.reduce_max(bits))
        near.append(tf.reduce_sum(tf.cast(bits >= threshold, tf.int64)))
    if len(outputs) == 1:
        return largest[0], near[0], size[0]
    return tf.reduce_max(tf.stack(largest)), tf.add_n(near), tf.add_n(size)


def headroom_of_tallies(largest, near, size) -> tf.Tensor:
    """[points, 2] float32: each point's [amax, near-max fraction] from its
    `forward_tallies` (each argument stacked over points): the amax is
    exact (NaN when an element was NaN), the fraction a float64 division
    of exact counts; [0, 0] where nothing was read. A few ops for every
    point at once.

    >>> headroom_of_tallies(
    ...     tf.constant([_float16_bits(5000.0), -32768], tf.int16),
    ...     tf.constant([2, 0], tf.int64),
    ...     tf.constant([4, 0], tf.int64)).numpy().tolist()
    [[5000.0, 0.5], [0.0, 0.0]]
    """
    amax = tf.cast(tf.bitcast(tf.maximum(largest, 0), tf.float16), tf.float32)
    share = tf.cast(near, tf.float64) / tf.cast(tf.maximum(size, 1), tf.float64)
    return tf.stack([amax, tf.cast(share, tf.float32)], axis=1)


def _float16_bits(value) -> int:
    """The bit pattern of the float16 `value` (exact), as an int."""
    return struct.unpack("<h", struct.pack("<e", value))[0]


# Float dtype -> (the integer of its width, the mask that clears its sign).
_BITS = types.MappingProxyType({
    tf.float16: (tf.int16, 0x7FFF),
    tf.bfloat16: (tf.int16, 0x7FFF),
    tf.float32: (tf.int32, 0x7FFFFFFF),
})


def _amax(gradient) -> tf.Tensor:
    """max |gradient| as float32, from one integer max-reduction over its
    bit pattern with the sign bit cleared: a float's magnitude orders as
    its bits without the sign, NaN's above inf's. Four ops (three for a
    float32 gradient): under XLA the
    mask fuses into the reduction (one read of the gradient); without it
    the mask writes a copy, as `abs` would, but float16 reductions are not
    vectorised on a CPU and integer ones are. (Two integer maxima, signed
    and unsigned, read the gradient twice and took 0.14-0.52 ms more per
    gradient under XLA on this project's machine; docs/performance.md.)

    >>> float(_amax(tf.constant([1.0, -3.0, -0.0], tf.float16)))
    3.0
    >>> float(_amax(tf.constant([1.0, -float("nan")], tf.float16)))
    nan
    >>> float(_amax(tf.zeros([0], tf.float16)))
    -0.0

    An empty gradient gives -0.0 (the integer maximum of nothing is the
    smallest integer, the bit pattern of -0.0), which equals 0 in every
    comparison the rule and the finiteness check make, without a fifth op
    to clamp it.
    """
    return amax_from_reduction(amax_reduction(gradient), gradient.dtype)


def amax_reduction(gradient) -> tf.Tensor:
    """`_amax`'s one read of `gradient`: the largest of its bit patterns
    with the sign cleared (an integer scalar of its width), or, for a
    dtype without one here, its largest magnitude in its own dtype.
    `amax_from_reduction` makes it the float32 amax: apart, so that a
    compiled function can take that scalar step (`choice.compiled_choice`).

    >>> reduced = amax_reduction(tf.constant([1.0, -3.0], tf.float16))
    >>> reduced.dtype.name, float(amax_from_reduction(reduced, tf.float16))
    ('int16', 3.0)
    """
    if gradient.dtype not in _BITS:
        return tf.reduce_max(tf.abs(gradient))
    return _largest_bits(gradient)


def amax_from_reduction(reduced, dtype) -> tf.Tensor:
    """The float32 amax of a tensor of `dtype` whose `amax_reduction` is
    `reduced` (elementwise: a stack of several tensors' reductions gives
    their amaxes)."""
    if dtype not in _BITS:
        return tf.cast(reduced, tf.float32)
    return tf.cast(tf.bitcast(reduced, dtype), tf.float32)


def _largest_bits(gradient) -> tf.Tensor:
    """The largest of `gradient`'s bit patterns with the sign cleared (an
    integer scalar; `_amax`)."""
    integer, magnitude = _BITS[gradient.dtype]
    bits = tf.bitwise.bitwise_and(tf.bitcast(gradient, integer), magnitude)
    return tf.reduce_max(bits)


def choose_scale_paper(
    gradients,
    current_scale,
    max_layer_scale,
    overflow_margin,
    underflow_rate,
    backoff=1.0,
    inherited=1.0,
) -> tf.Tensor:
    """The ALS paper's per-layer scale (float32, a power of two): the
    reciprocal of the `underflow_rate` quantile of the incoming gradient's
    nonzero magnitudes, rounded down to a power of two, then capped as
    the default rule caps (never above what safety allows for the
    gradient's amax, within [1 / inherited, max_layer_scale]). Kept at
    `current_scale` when every element is zero or one is not finite.

    The quantile is `tfp.stats.percentile` (lower interpolation) of the
    magnitudes, a sort: this runs every `update_interval` steps, never
    on every step.

    Example: the 1% quantile of (1..100) * 2**-20 is 2**-20, whose
    reciprocal 2**20 is above `max_layer_scale`; times 2**16, the quantile
    2**-4 asks for 16, but the amax, 6.25, leaves room for 2 below
    float16's maximum with a margin of 2**12:

    >>> g = tf.range(1.0, 101.0) * 2.0**-20
    >>> float(choose_scale_paper(g, 1.0, 2.0**15, 2.0**12, 0.01))
    32768.0
    >>> float(choose_scale_paper(g * 2.0**16, 1.0, 2.0**15, 2.0**12, 0.01))
    2.0
    >>> float(choose_scale_paper(g * 2.0**16, 1.0, 2.0**15, 1.0, 0.01))
    16.0
    """
    quantile = nonzero_quantile(gradients, underflow_rate)
    safe = safe_exponent(amax_of(gradients), overflow_margin, backoff)
    # The largest power of two <= 1 / quantile, exactly.
    low = _pow2.floor_log2(quantile)
    reciprocal = tf.where(tf.equal(_pow2.pow2(low), quantile), -low, -low - 1)
    max_exponent = _pow2.floor_log2(tf.cast(max_layer_scale, tf.float32))
    min_exponent = -_pow2.floor_log2(tf.cast(inherited, tf.float32))
    exponent = tf.clip_by_value(
        tf.minimum(reciprocal, safe), min_exponent, max_exponent
    )
    usable = tf.logical_and(
        usable_amax(amax_of(gradients), backoff),
        tf.logical_and(quantile > 0.0, tf.math.is_finite(quantile)),
    )
    return tf.where(usable, _pow2.pow2(exponent), tf.cast(current_scale, tf.float32))


def nonzero_quantile(gradients, rate) -> tf.Tensor:
    """The `rate` quantile (lower interpolation, as numpy's
    `method="lower"`) of the nonzero magnitudes of `gradients` (pooled), in
    float32, computed with `tfp.stats.percentile`; 0 when every element is
    zero. Zeros are moved past the end (as +inf) and the percentile is
    asked for the rank the nonzero elements alone would give it, so the
    shape stays static (XLA compiles it).

    >>> float(nonzero_quantile(tf.constant([0.0, 0.0, 3.0, -1.0, 2.0]), 0.5))
    2.0
    """
    import tensorflow_probability as tfp  # Only the "paper" rule needs it.

    if not isinstance(gradients, (list, tuple)):
        gradients = [gradients]
    magnitudes = tf.concat(
        [tf.abs(tf.reshape(tf.cast(g, tf.float32), [-1])) for g in gradients], 0
    )
    nonzero = tf.cast(tf.math.count_nonzero(magnitudes), tf.float64)
    size = tf.cast(tf.size(magnitudes), tf.float64)
    rank = tf.floor(
        as_float64(rate) * tf.maximum(nonzero - 1.0, 0.0) * (1.0 + 2.0**-40)
    )
    # tfp takes index floor((size - 1) * q / 100): aim at the middle of
    # the rank, so that rounding cannot move it.
    q = 100.0 * (rank + 0.5) / tf.maximum(size - 1.0, 1.0)
    moved = tf.where(magnitudes > 0.0, magnitudes, float("inf"))
    value = tfp.stats.percentile(
        moved, tf.minimum(q, 100.0), interpolation="lower"
    )
    return tf.where(nonzero > 0, value, 0.0)


def safe_exponent(amax, overflow_margin, backoff=1.0) -> tf.Tensor:
    """The largest k (int32) with amax * backoff * overflow_margin * 2**k
    <= float16's maximum: the scale exponent that safety allows, before the
    clip to [1 / inherited, max_layer_scale] (elementwise).

    The gradient times a power of two 2**f allows exactly k - f (the test
    against float16's maximum reads the mantissa, which 2**f keeps). The
    paper's rule caps its scale with it.

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


def as_float64(value):
    """A Python float goes to float64 directly (0.01 must not pass through
    float32 on the way); a tensor is cast."""
    if tf.is_tensor(value):
        return tf.cast(value, tf.float64)
    return tf.constant(value, tf.float64)
