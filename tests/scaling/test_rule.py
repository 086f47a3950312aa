"""Tests of `rule` and `_pow2`: the pure rule, on crafted
tensors, with exact expected values derived by hand.

Every check runs through the `run` fixture in three named modes: eager,
`tf.function` and XLA (`tf.function(jit_compile=True)`). Inputs are passed
as arguments, so the compiled modes see placeholders, not constants. A table
of cases is evaluated in one traced call (tracing and XLA compilation
dominate the runtime); a failing row is named in the assertion message.

All comparisons are exact (no tolerance): the rule only uses comparisons,
powers of two and sorting, and every fraction below is 0, 1 or has a
power-of-two denominator (tensor sizes 1, 4, 8, 128), so float32 holds the
expected values exactly whatever order a backend divides or folds in.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from tf_als._src.scaling import _pow2
from tf_als._src.scaling import rule
from tf_als._src.scaling import tallies
from tests.modes import MODES, compiled

INF = float("inf")
NAN = float("nan")
F16_MAX = 65504.0
F16_MIN_NORMAL = 2.0**-14
F16_MIN_SUBNORMAL = 2.0**-24

@pytest.fixture(params=MODES)
def run(request):
    """`run(fn, *tensors)` calls `fn` in the mode of the test case and returns
    its outputs as numpy values (structure kept)."""

    def run(fn, *args):
        # autograph=False: the rule has no tensor-dependent Python control
        # flow, and converting tfp's percentile costs time.
        outputs = compiled(fn, request.param, autograph=False)(*args)
        return tf.nest.map_structure(lambda t: t.numpy(), outputs)

    return run


def assert_exact(actual, expected, dtype=np.float32, what=""):
    """Same dtype, same shape, same values (NaN matches NaN)."""
    actual = np.asarray(actual)
    expected = np.asarray(expected, dtype=dtype)
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    np.testing.assert_array_equal(actual, expected, err_msg=str(what))


def power_of_two_below(value):
    """The percentile's contract: the exact quantile `value` (worked out by
    hand in each test) rounded down to a power of two; 0 and inf stay."""
    value = float(value)
    if value <= 0.0 or not math.isfinite(value):
        return value
    return 2.0 ** math.floor(math.log2(value))


def assert_statistics(stats, percentile, amax, zero, subnormal, near_max, what=""):
    """`percentile` is the exact quantile; the statistic must equal it
    rounded down to a power of two."""
    assert isinstance(stats, tallies.GradientStatistics)
    expected = dict(
        percentile=power_of_two_below(percentile),
        amax=amax,
        zero_fraction=zero,
        subnormal_fraction=subnormal,
        near_max_fraction=near_max,
    )
    for field, value in expected.items():
        assert_exact(getattr(stats, field), value, what=f"{what} {field}")


def f32(values):
    return tf.constant(values, tf.float32)


def f16(values):
    return tf.constant(values, tf.float16)


def next_up(x):
    return float(np.nextafter(np.float32(x), np.float32(INF)))


def next_down(x):
    return float(np.nextafter(np.float32(x), np.float32(0.0)))


# --------------------------------------------------------------------------
# _pow2
# --------------------------------------------------------------------------


def test_floor_log2_exact_on_every_normal_power_of_two(run):
    exponents = np.arange(-126, 128)
    x = np.ldexp(np.float32(1.0), exponents).astype(np.float32)
    assert_exact(run(_pow2.floor_log2, tf.constant(x)), exponents, np.int32)


def test_floor_log2_just_below_and_above_powers_of_two(run):
    # 2**e * (1 - 2**-24) lies in [2**(e-1), 2**e): floor is e - 1.
    # 2**e * (1 + 2**-23) lies in [2**e, 2**(e+1)): floor is e.
    # e starts at -125 so that the value just below is still normal; the
    # float32 maximum 2**127 * (2 - 2**-23) stands in for "above 2**127".
    exponents = np.arange(-125, 128)
    powers = np.ldexp(np.float32(1.0), exponents).astype(np.float32)
    below = np.nextafter(powers, np.float32(0.0))
    above = np.nextafter(powers, np.float32(INF))
    above[-1] = np.finfo(np.float32).max
    out_below, out_above = run(
        lambda b, a: (_pow2.floor_log2(b), _pow2.floor_log2(a)),
        tf.constant(below),
        tf.constant(above),
    )
    assert_exact(out_below, exponents - 1, np.int32)
    assert_exact(out_above, exponents, np.int32)


def test_floor_log2_non_powers(run):
    # 0.75 in [1/2, 1) -> -1; 1.5 in [1, 2) -> 0; 3 in [2, 4) -> 1;
    # 1000 in [512, 1024) -> 9; 1e-3 in [2**-10, 2**-9) -> -10.
    x = f32([0.75, 1.5, 3.0, 1000.0, 1e-3])
    assert_exact(run(_pow2.floor_log2, x), [-1, 0, 1, 9, -10], np.int32)


def test_floor_log2_float16_extremes(run):
    # float16 input is read through float32: smallest subnormal 2**-24,
    # smallest normal 2**-14, largest subnormal 2**-14 - 2**-24 (in
    # [2**-15, 2**-14)), and the maximum 65504 = 2**15 * (2 - 2**-10).
    x = f16([F16_MIN_SUBNORMAL, F16_MIN_NORMAL, F16_MIN_NORMAL - F16_MIN_SUBNORMAL, F16_MAX])
    assert_exact(run(_pow2.floor_log2, x), [-24, -14, -15, 15], np.int32)


def test_pow2_exact_on_the_float32_normal_range_and_back(run):
    exponents = np.arange(-126, 128, dtype=np.int32)
    expected = np.ldexp(np.float32(1.0), exponents).astype(np.float32)
    powers, back = run(
        lambda e: (_pow2.pow2(e), _pow2.floor_log2(_pow2.pow2(e))),
        tf.constant(exponents),
    )
    assert_exact(powers, expected)
    assert_exact(back, exponents, np.int32)


def test_pow2_float16_extremes(run):
    e = tf.constant([-24, -14, 15, 16], tf.int32)
    assert_exact(run(_pow2.pow2, e), [2.0**-24, 2.0**-14, 32768.0, 65536.0])


def test_pow2_clips_to_the_float32_normal_range(run):
    # Below -126 gives 2**-126 (not a subnormal, not 0); above 127 gives
    # 2**127 (not inf).
    e = tf.constant([-127, -1000, -(2**30), 128, 1000, 2**30], tf.int32)
    expected = [2.0**-126] * 3 + [2.0**127] * 3
    assert_exact(run(_pow2.pow2, e), expected)


def test_pow2_accepts_int64_exponents(run):
    e = tf.constant([0, 3, -14], tf.int64)
    assert_exact(run(_pow2.pow2, e), [1.0, 8.0, 2.0**-14])



# --------------------------------------------------------------------------
# One gradient's telemetry, as the training step derives it for many points
# at once (`tallies.tallies`, then `tallies.statistics_of_tallies`).
# --------------------------------------------------------------------------


def gradient_statistics(gradients, underflow_rate) -> tallies.GradientStatistics:
    """The statistics of one gradient (or a pooled list of them)."""
    statistics, _ = tallies.statistics_of_tallies(
        tallies.tallies([gradients]), underflow_rate
    )
    return tallies.GradientStatistics(*[field[0] for field in statistics])


def log2_histogram(gradients) -> tf.Tensor:
    """The log2 histogram of one gradient: fractions per exponent of
    `tallies.HISTOGRAM_EXPONENTS` (zeros and non-finite elements in no bin)."""
    _, histograms = tallies.statistics_of_tallies(tallies.tallies([gradients]), 0.0)
    return histograms[0]


# --------------------------------------------------------------------------
# gradient_statistics
# --------------------------------------------------------------------------


def _statistics_at_rates(run, gradients, rates):
    """gradient_statistics of `gradients` at each rate, in one traced call."""
    return run(
        lambda g: [gradient_statistics(g, rate) for rate in rates],
        gradients,
    )


def test_statistics_all_zero(run):
    outputs = run(
        lambda a, b: [gradient_statistics(g, 0.01) for g in (a, b)],
        tf.zeros([4, 2], tf.float16),
        tf.zeros([8], tf.float32),
    )
    for dtype, stats in zip(("float16", "float32"), outputs):
        assert_statistics(
            stats, percentile=0.0, amax=0.0, zero=1.0, subnormal=0.0, near_max=0.0, what=dtype
        )


# Five float16 subnormals 2**-20 .. 2**-16, shuffled, with signs. The nonzero
# magnitudes sorted are [2**-20, 2**-19, 2**-18, 2**-17, 2**-16]; 'lower'
# picks index floor(rate * (5 - 1)).
SUBNORMALS = [2.0**-18, -(2.0**-16), 2.0**-20, -(2.0**-17), 2.0**-19]
SUBNORMAL_PERCENTILES = [
    (0.0, 2.0**-20),  # floor(0 * 4) = 0
    (0.01, 2.0**-20),  # floor(0.04) = 0
    (0.3, 2.0**-19),  # floor(1.2) = 1
    (0.5, 2.0**-18),  # floor(2.0) = 2, an exact integer
    (0.75, 2.0**-17),  # floor(3.0) = 3, an exact integer
    (0.99, 2.0**-17),  # floor(3.96) = 3
]


def test_statistics_subnormal_only_float16(run):
    rates, percentiles = zip(*SUBNORMAL_PERCENTILES)
    outputs = _statistics_at_rates(run, f16(SUBNORMALS), rates)
    for rate, expected, stats in zip(rates, percentiles, outputs):
        # Every element is nonzero and below 2**-14; none is near the max.
        assert_statistics(
            stats,
            percentile=expected,
            amax=2.0**-16,
            zero=0.0,
            subnormal=1.0,
            near_max=0.0,
            what=f"rate={rate}",
        )


def test_statistics_smallest_subnormal_and_smallest_normal(run):
    # 2**-24 is a (nonzero) subnormal; 2**-14 is normal, not subnormal;
    # 2**-14 - 2**-24 is the largest subnormal. Size 4: 2 subnormals, 1 zero.
    g = f16([F16_MIN_SUBNORMAL, F16_MIN_NORMAL, F16_MIN_NORMAL - F16_MIN_SUBNORMAL, 0.0])
    [stats] = _statistics_at_rates(run, g, [0.0])
    assert_statistics(
        stats,
        percentile=F16_MIN_SUBNORMAL,
        amax=F16_MIN_NORMAL,
        zero=0.25,
        subnormal=0.5,
        near_max=0.0,
    )


def test_statistics_near_overflow_float16(run):
    # The threshold is 2**15 = 32768, float16's largest power of two
    # (65504 / 2 = 32752 is the float16 just below it). Counted: 65504,
    # -32768. Not counted: 32752, 1, 2, -4, 0.5, 0. Size 8 -> 2/8. Nonzero
    # sorted: [0.5, 1, 2, 4, 32752, 32768, 65504]; rate 0.5 ->
    # floor(0.5 * 6) = 3 -> 4.
    g = f16([[65504.0, -32768.0, 32752.0, 1.0], [0.0, 2.0, -4.0, 0.5]])
    [stats] = _statistics_at_rates(run, g, [0.5])
    assert_statistics(stats, percentile=4.0, amax=F16_MAX, zero=0.125, subnormal=0.0, near_max=0.25)


def test_statistics_near_max_counts_non_finite(run):
    # inf, -inf and NaN are all "near the max" (>= is False for NaN, so it
    # must be counted explicitly). 1 is not. Size 4 -> 3/4.
    [stats] = _statistics_at_rates(run, f32([INF, 1.0, -INF, NAN]), [0.01])
    assert_exact(stats.near_max_fraction, 0.75)
    assert_exact(stats.zero_fraction, 0.0)
    assert_exact(stats.subnormal_fraction, 0.0)


# Eight elements, five nonzero: sorted nonzero magnitudes [1, 2, 3, 4, 5].
# With the zeros counted, rate 0.5 would give floor(0.5 * 7) = 3 -> 1, not 3.
MIXED = [0.0, -5.0, 3.0, 0.0, 1.0, -4.0, 0.0, 2.0]
MIXED_PERCENTILES = [
    (0.0, 1.0),  # floor(0) = 0: the smallest NONZERO, not 0
    (0.2, 1.0),  # floor(0.8) = 0
    (0.24, 1.0),  # floor(0.96) = 0
    (0.25, 2.0),  # floor(1.0) = 1, exact integer
    (0.26, 2.0),  # floor(1.04) = 1
    (0.5, 3.0),  # floor(2.0) = 2, exact integer
    (0.75, 4.0),  # floor(3.0) = 3, exact integer
    (0.99, 4.0),  # floor(3.96) = 3
]


def test_statistics_percentile_ignores_zeros(run):
    rates, percentiles = zip(*MIXED_PERCENTILES)
    outputs = _statistics_at_rates(run, f32(MIXED), rates)
    for rate, expected, stats in zip(rates, percentiles, outputs):
        assert_statistics(
            stats,
            percentile=expected,
            amax=5.0,
            zero=0.375,
            subnormal=0.0,
            near_max=0.0,
            what=f"rate={rate}",
        )


# 1 .. 101 (index i holds i + 1 once sorted) and 27 zeros, shuffled: size 128.
HUNDRED_AND_ONE = np.random.default_rng(0).permutation(
    np.concatenate([np.arange(1, 102), np.zeros(27)]).astype(np.float32)
)
HUNDRED_AND_ONE_PERCENTILES = [
    # index = rate * 100 for the decimal rate the caller wrote. In float64
    # the products are 1.0, 28.999999999999996 and 56.99999999999999: a
    # plain floor would pick indices 28 and 56.
    (0.01, 2.0),  # index 1 (the default rate)
    (0.29, 30.0),  # index 29
    (0.57, 58.0),  # index 57
    (0.015, 2.0),  # floor(1.5) = 1
    (0.995, 100.0),  # floor(99.5) = 99
]


def test_statistics_percentile_exact_integer_index(run):
    rates, percentiles = zip(*HUNDRED_AND_ONE_PERCENTILES)
    outputs = _statistics_at_rates(run, tf.constant(HUNDRED_AND_ONE), rates)
    for rate, expected, stats in zip(rates, percentiles, outputs):
        assert_statistics(
            stats,
            percentile=expected,
            amax=101.0,
            zero=27 / 128,
            subnormal=0.0,
            near_max=0.0,
            what=f"rate={rate}",
        )


def test_statistics_percentile_index_just_below_an_integer(run):
    # Nonzero sorted [1, 2, 3, 4]; floor(0.9999999 * 3) = floor(2.9999997)
    # = 2 -> 3.
    [stats] = _statistics_at_rates(run, f32([4.0, 1.0, 3.0, 2.0]), [0.9999999])
    assert_exact(stats.percentile, power_of_two_below(3.0))


def test_statistics_underflow_rate_as_a_tensor(run):
    # MIXED at rate 0.5: floor(0.5 * 4) = 2 -> 3 (see MIXED_PERCENTILES).
    stats = run(
        lambda g, rate: gradient_statistics(g, rate),
        f32(MIXED),
        tf.constant(0.5, tf.float32),
    )
    assert_exact(stats.percentile, power_of_two_below(3.0))


def _amax_of_each(run, rows):
    """amax of each row, as float16 and as float32, in one traced call."""
    tensors = [tf.constant(v, d) for v in rows for d in (tf.float16, tf.float32)]
    outputs = run(
        lambda gs: [gradient_statistics(g, 0.01).amax for g in gs], tensors
    )
    return [(t.dtype.name, o) for t, o in zip(tensors, outputs)]


def test_statistics_amax_propagates_nan(run):
    # NaN anywhere (also next to inf) makes amax NaN; a max reduction alone
    # may drop NaN.
    rows = [[1.0, NAN, 2.0, 0.0], [INF, NAN, 2.0, 0.0], [-NAN, -INF, 2.0, 0.0]]
    for row, (dtype, amax) in zip(np.repeat(rows, 2, axis=0), _amax_of_each(run, rows)):
        assert_exact(amax, NAN, what=(row, dtype))


def test_statistics_amax_propagates_inf(run):
    rows = [[1.0, INF, 2.0, 0.0], [1.0, -INF, 2.0, 0.0]]
    for row, (dtype, amax) in zip(np.repeat(rows, 2, axis=0), _amax_of_each(run, rows)):
        assert_exact(amax, INF, what=(row, dtype))


# float16 [[0, 2**-20], [1, 2]] and float32 [1e-30, 70000, 0, 3]: the float32
# values are not float16 (1e-30 would flush to 0, 70000 would be inf), so
# they prove pooling happens in float32.
# Size 8: zeros 2/8; nonzero below 2**-14: 2**-20 and 1e-30 -> 2/8;
# >= 2**15: 70000 -> 1/8; amax 70000.
# Nonzero sorted [1e-30, 2**-20, 1, 2, 3, 70000], 'lower' index
# floor(rate * 5).
POOL_F16 = [[0.0, 2.0**-20], [1.0, 2.0]]
POOL_F32 = [1e-30, 70000.0, 0.0, 3.0]
POOL_PERCENTILES = [
    (0.0, np.float32(1e-30)),  # index 0
    (0.2, 2.0**-20),  # floor(1.0) = 1, exact integer
    (0.5, 1.0),  # floor(2.5) = 2
]


def test_statistics_pools_a_list_of_dtypes(run):
    rates, percentiles = zip(*POOL_PERCENTILES)

    def fn(x, y):
        # Both orders, and a tuple as well as a list.
        return [gradient_statistics([x, y], r) for r in rates] + [
            gradient_statistics((y, x), r) for r in rates
        ]

    outputs = run(fn, f16(POOL_F16), f32(POOL_F32))
    for rate, expected, stats in zip(rates * 2, percentiles * 2, outputs):
        assert_statistics(
            stats,
            percentile=expected,
            amax=70000.0,
            zero=0.25,
            subnormal=0.25,
            near_max=0.125,
            what=f"rate={rate}",
        )


def test_statistics_single_element(run):
    [stats] = _statistics_at_rates(run, f32([-3.0]), [0.01])
    assert_statistics(stats, percentile=3.0, amax=3.0, zero=0.0, subnormal=0.0, near_max=0.0)


# --------------------------------------------------------------------------
# the per-step rule: scale_within(amax, headroom(margin, backoff), ...)
# --------------------------------------------------------------------------
#
# Rule (rule module docstring), as the backward pass composes it: with
# a = amax * backoff, k_cap = largest k with a * 2**k * margin <= 65504;
# s = 2**clip(k_cap, -log2(inherited), log2(max_layer_scale));
# s = 1 if amax is 0 or NaN (the point then neither lifts nor gives back).
# Defaults below: margin 2**12, ceiling 2**15, backoff 1.


def choose(amax, max_layer_scale, margin, backoff=1.0, inherited=1.0):
    """The scale a point chooses, composed exactly as `choice.Choice.scale`
    composes the rule's functions (`headroom` once per pass, then
    `scale_within` per point)."""
    return rule.scale_within(
        amax, rule.headroom(margin, backoff), max_layer_scale, inherited
    )


def _choose_table(run, rows):
    """rows: dicts with amax, expected and optionally max_layer_scale,
    margin, backoff, inherited (Python floats, passed as constants); amax
    is passed as a tensor. One traced call for all."""

    def fn(amaxes):
        return [
            choose(
                amax,
                row.get("max_layer_scale", 2.0**15),
                row.get("margin", 2.0**12),
                row.get("backoff", 1.0),
                row.get("inherited", 1.0),
            )
            for row, amax in zip(rows, amaxes)
        ]

    amaxes = [tf.constant(row["amax"], tf.float32) for row in rows]
    outputs = run(fn, amaxes)
    for row, out in zip(rows, outputs):
        assert_exact(out, row["expected"], what=row)


def test_choose_scale_cap_at_power_of_two_boundaries(run):
    _choose_table(
        run,
        [
            # 2**-10 * 2**(k+12) = 2**(k+2) <= 65504 -> k = 13 (2**15 =
            # 32768; 2**16 = 65536 is too big).
            dict(amax=2.0**-10, expected=2.0**13),
            # 65504 / 2**12 * 2**k * 2**12 = 65504 * 2**k <= 65504 -> k = 0:
            # equality is allowed.
            dict(amax=F16_MAX / 2**12, expected=1.0),
            # 65504 / 2**13: 65504 * 2**(k-1) -> k = 1, again at equality.
            dict(amax=F16_MAX / 2**13, expected=2.0),
            # One float32 ulp above: k = 1 exceeds 65504 -> k = 0.
            dict(amax=next_up(F16_MAX / 2**13), expected=1.0),
            # 65504 / 2**25: 65504 * 2**(k-13) -> k = 13 at equality; one ulp
            # above -> 12.
            dict(amax=F16_MAX / 2**25, expected=2.0**13),
            dict(amax=next_up(F16_MAX / 2**25), expected=2.0**12),
            # 2**-3: 2**(k+9) <= 65504 -> k = 6. 65504 / 2**19 (just below
            # 2**-3) allows k = 7 at equality; the float32 just below 2**-3
            # does not (2**16 * (1 - 2**-24) > 65504) -> 6.
            dict(amax=2.0**-3, expected=64.0),
            dict(amax=F16_MAX / 2**19, expected=128.0),
            dict(amax=next_down(2.0**-3), expected=64.0),
            # 3: 3 * 2**(k+12) <= 65504 -> 2**(k+12) <= 21834.7 -> k = 2.
            dict(amax=3.0, expected=4.0),
        ],
    )


def test_scale_within_is_the_largest_power_of_two_on_random_inputs(run):
    """On 20,000 amaxes of float16 gradients (2**-24 to 2**15, random
    mantissas), limits (0, and 2**-40 to 65504 with random mantissas) and
    inherited scales: s is a power of two within [1 / inherited, ceiling];
    where it lies strictly inside, amax * s <= limit < amax * 2s, checked in
    float64, where a float32 times a power of two is exact."""
    rng = np.random.default_rng(7)
    n = 20000
    amax = np.abs(rng.standard_normal(n)) * 2.0 ** rng.integers(-24, 15, n)
    amax = amax.astype(np.float16).astype(np.float32)
    amax[amax == 0] = 2.0**-24
    limit = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-40, 15, n)).astype(np.float32)
    limit[::50] = 0.0
    inherited = (2.0 ** rng.integers(-8, 24, n)).astype(np.float32)
    ceiling = 2.0**12
    s = run(
        lambda a, l, t: rule.scale_within(a, l, ceiling, t),
        tf.constant(amax), tf.constant(limit), tf.constant(inherited),
    )
    s = np.asarray(s, np.float64)
    mantissa, _ = np.frexp(s)
    assert np.all(mantissa == 0.5)  # Powers of two.
    low = 1.0 / inherited.astype(np.float64)
    assert np.all((s >= low) & (s <= ceiling))
    inside = (s > low) & (s < ceiling)
    assert inside.sum() > n // 4  # The property below tested on many.
    a, lim = amax.astype(np.float64)[inside], limit.astype(np.float64)[inside]
    assert np.all(a * s[inside] <= lim)
    assert np.all(a * 2 * s[inside] > lim)
    # At the floor, even 1 / inherited may not fit; at the ceiling, 2s may.
    top = s == ceiling
    assert np.all(amax.astype(np.float64)[top] * ceiling <= limit[top])


def test_choose_scale_clips_to_one_and_the_ceiling(run):
    _choose_table(
        run,
        [
            # 2**-40 * 2**(k+12) <= 65504 -> k = 43; clipped to the ceiling.
            dict(amax=2.0**-40, expected=2.0**15),
            dict(amax=2.0**-40, max_layer_scale=2.0**4, expected=16.0),
            dict(amax=2.0**-40, max_layer_scale=1.0, expected=1.0),
            # 2**-10 allows 2**13 (above); a ceiling of 2**10 wins, one of
            # 2**14 does not raise it.
            dict(amax=2.0**-10, max_layer_scale=2.0**10, expected=2.0**10),
            dict(amax=2.0**-10, max_layer_scale=2.0**14, expected=2.0**13),
            # Cap below 0 is clipped to 1: 16 * 2**(k+12) = 2**(k+16) ->
            # k = -1; 65504 -> k = -12; 1e30 -> far below.
            dict(amax=16.0, expected=1.0),
            dict(amax=F16_MAX, expected=1.0),
            dict(amax=1e30, expected=1.0),
            # amax * margin overflows float32 to inf: still 1.
            dict(amax=3e38, expected=1.0),
            # The smallest normal float32, far below any float16:
            # 2**-126 * 2**(k+12) <= 65504 -> k = 129; clipped.
            # (Float32 subnormal amaxes are not tested: TensorFlow's CPU
            # kernels flush them to zero, so they count as all-zero.)
            dict(amax=2.0**-126, expected=2.0**15),
            dict(amax=2.0**-126, max_layer_scale=2.0**7, expected=2.0**7),
        ],
    )


def test_choose_scale_gives_back_inherited_lift(run):
    """A point whose gradient arrives with too little headroom gives back
    the lift T_out it inherited from downstream, as far as T_in = 1."""
    _choose_table(
        run,
        [
            # 16 * 2**(k+12) = 2**(k+16) -> k = -1: half of 64 given back.
            dict(amax=16.0, inherited=64.0, expected=0.5),
            # 65504 -> k = -12, but no lower than 1/64.
            dict(amax=F16_MAX, inherited=64.0, expected=2.0**-6),
            dict(amax=1e30, inherited=64.0, expected=2.0**-6),
            dict(amax=3e38, inherited=2.0**20, expected=2.0**-20),
            # Headroom left: the inherited lift changes nothing.
            dict(amax=2.0**-10, inherited=64.0, expected=2.0**13),
            dict(amax=F16_MAX / 2**12, inherited=64.0, expected=1.0),
            # One ulp above that equality -> k = -1.
            dict(amax=next_up(F16_MAX / 2**12), inherited=64.0, expected=0.5),
            # Back-off counts as before: 16 * 2 * 2**(k+12) -> k = -2.
            dict(amax=16.0, backoff=2.0, inherited=64.0, expected=0.25),
            # No information (all zero, NaN): neutral, 1. An inf amax gives
            # back all the lift (the step is skipped and the choice not kept).
            dict(amax=float("nan"), inherited=64.0, expected=1.0),
            dict(amax=0.0, inherited=64.0, expected=1.0),
            dict(amax=INF, inherited=64.0, expected=2.0**-6),
        ],
    )


def test_choose_scale_other_margins(run):
    _choose_table(
        run,
        [
            dict(amax=1.0, margin=1.0, expected=2.0**15),  # 2**k -> k = 15
            dict(amax=2.0, margin=1.0, expected=2.0**14),  # 2**(k+1) -> 14
            dict(amax=2.0**-10, margin=1.0, expected=2.0**15),  # 25, clipped
            dict(amax=1.0, margin=2.0, expected=2.0**14),  # 2**(k+1) -> 14
            dict(amax=1.0, margin=2.0**8, expected=2.0**7),  # 2**(k+8) -> 7
            dict(amax=1.0, margin=2.0**15, expected=1.0),  # 2**(k+15) -> 0
            # 3 * 2**(k+4) <= 65504 -> 2**(k+4) <= 21834.7 -> k = 10.
            dict(amax=3.0, margin=2.0**4, expected=2.0**10),
            # 65504 * 2**k -> k = 0 at equality.
            dict(amax=F16_MAX, margin=1.0, expected=1.0),
            # 32752 * 2**k -> k = 1 at equality; one ulp above -> 0.
            dict(amax=F16_MAX / 2, margin=1.0, expected=2.0),
            dict(amax=next_up(F16_MAX / 2), margin=1.0, expected=1.0),
        ],
    )


def test_choose_scale_backoff(run):
    _choose_table(
        run,
        [
            # backoff 1 is no change: 2**-10 -> 2**13 as above.
            dict(amax=2.0**-10, backoff=1.0, expected=2.0**13),
            # 2**-10 * 4 = 2**-8: 2**(k+4) <= 65504 -> k = 11. The global
            # scale backed off by 4 and so did the amax: the per-layer scale
            # stays where it was for the un-backed-off amax 2**-8.
            dict(amax=2.0**-10, backoff=4.0, expected=2.0**11),
            # (65504 / 2**13) * 2 = 65504 / 2**12 -> k = 0 at equality.
            dict(amax=F16_MAX / 2**13, backoff=2.0, expected=1.0),
            # Not a power of two: 1 * 3 * 2**k <= 65504 (margin 1) -> k = 14.
            dict(amax=1.0, backoff=3.0, margin=1.0, expected=2.0**14),
            # Still clipped to the ceiling: 2**-40 * 2**10 -> k = 33.
            dict(amax=2.0**-40, backoff=2.0**10, expected=2.0**15),
            # No information stays neutral whatever the backoff.
            dict(amax=0.0, backoff=8.0, expected=1.0),
            dict(amax=NAN, backoff=8.0, expected=1.0),
            dict(amax=INF, backoff=8.0, expected=1.0),
        ],
    )


def test_choose_scale_accepts_tensor_knobs(run):
    # amax 2**-10, margin 2**12, ceiling 2**15 -> 2**13 (as above); with
    # ceiling 2**10 -> 2**10. Backoff and T_out come from variables in
    # training: tensors too.
    def fn(amax, backoff, ceiling, margin):
        return choose(amax, ceiling, margin, backoff, tf.constant(1.0))

    args = [tf.constant(v, tf.float32) for v in (2.0**-10, 1.0, 2.0**15, 2.0**12)]
    assert_exact(run(fn, *args), 2.0**13)
    args[2] = tf.constant(2.0**10, tf.float32)
    assert_exact(run(fn, *args), 2.0**10)


def test_choose_scale_is_neutral_without_information(run):
    # All zero or NaN: 1, whatever the knobs; the paper's rule, which keeps
    # a scale between updates, keeps its current one instead (below).
    _choose_table(
        run,
        [
            dict(amax=amax, max_layer_scale=ceiling, margin=margin, expected=1.0)
            for amax in (0.0, NAN)
            for ceiling in (1.0, 2.0**9, 2.0**15)
            for margin in (1.0, 2.0**12)
        ],
    )


def test_choose_scale_from_gradients(run):
    # End to end on tensors, as a point runs it (`amax_of` first), margin
    # 2**12, ceiling 2**15.
    cases = [
        ("all zero: neutral", [0.0] * 4, 1.0),
        ("inf: T_in = 1", [1.0, INF, 0.0, 2.0], 1.0),
        ("nan: neutral", [1.0, NAN, 0.0, 2.0], 1.0),
        # Subnormal only, amax 2**-16: 2**(k-4) <= 65504 -> k = 19 -> 2**15.
        ("subnormal only", SUBNORMALS, 2.0**15),
        # amax 65504 -> k = -12 -> 1; amax 32752 -> k = -11 -> 1.
        ("float16 max", [65504.0, 1.0, 0.0, -2.0], 1.0),
        ("near max", [-32752.0, 1.0, 0.0, 2.0**-20], 1.0),
        # amax 2**-10 (negative sign) -> 2**13.
        ("amax 2**-10", [2.0**-12, -(2.0**-10), 0.0, 2.0**-20], 2.0**13),
    ]

    def fn(gradients):
        return [choose(rule.amax_of(g), 2.0**15, 2.0**12) for g in gradients]

    outputs = run(fn, [f16(values) for _, values, _ in cases])
    for (what, _, expected), out in zip(cases, outputs):
        assert_exact(out, expected, what=what)


# --------------------------------------------------------------------------
# tally: what a scaling point measures; statistics_of_tallies: the rest
# --------------------------------------------------------------------------


def _numpy_tally(values):
    """The tally from numpy, independently of the bit pattern: amax, the
    zeros, then per binary exponent e (from `np.frexp` in float64) the
    count of nonzero finite magnitudes in [2**e, 2**(e+1)), then the
    non-finite ones."""
    magnitudes = np.abs(np.asarray(values, np.float64)).ravel()
    finite = np.isfinite(magnitudes)
    counts = np.zeros([256], np.float64)
    counts[0] = np.sum(magnitudes == 0.0)
    counts[255] = np.sum(~finite)
    nonzero = magnitudes[finite & (magnitudes > 0.0)]
    exponents = np.frexp(nonzero)[1] - 1  # m * 2**e with m in [0.5, 1)
    np.add.at(counts, exponents + 127, 1.0)
    amax = np.nan if np.isnan(magnitudes).any() else magnitudes.max()
    return np.concatenate([[amax], counts]).astype(np.float32)


TALLY_CASES = [
    ("pooled f16 + f32", [f16(POOL_F16), f32(np.reshape(POOL_F32, [2, 2]))]),
    ("mixed", [f32(MIXED)]),
    ("subnormal f16", [f16(SUBNORMALS)]),
    ("near max", [f16([[65504.0, -32768.0, 32752.0, 1.0], [0.0, 2.0, -4.0, 0.5]])]),
    ("zero", [tf.zeros([4], tf.float16)]),
    ("non-finite", [f32([1.0, NAN, 0.0, -INF, 2.0**-126, 2.0**127])]),
]


def test_tally_counts_every_binary_exponent(run):
    """amax and one count per exponent, against numpy's frexp: float16
    subnormals are float32 normals, so each has its own exponent."""
    outputs = run(lambda gs: tf.unstack(tallies.tallies(gs)), [g for _, g in TALLY_CASES])
    for (what, gradients), out in zip(TALLY_CASES, outputs):
        values = np.concatenate([np.asarray(g, np.float64).ravel() for g in gradients])
        assert out.shape == (tallies.TALLY_SIZE,)
        assert_exact(out, _numpy_tally(values), what=what)


def test_statistics_of_tallies_keeps_rows_apart(run):
    """Every row of a [points, TALLY_SIZE] batch gives the statistics and
    histogram of its own gradient, whatever the other rows hold."""
    gradients = [g for _, g in TALLY_CASES]

    def fn(gs):
        stats, histograms = tallies.statistics_of_tallies(
            tallies.tallies(gs), 0.5
        )
        return stats, histograms, [
            gradient_statistics(g, 0.5) for g in gs
        ], [log2_histogram(g) for g in gs]

    stats, histograms, alone, alone_histograms = run(fn, gradients)
    for i, (what, _) in enumerate(TALLY_CASES):
        row = _stats_vector([field[i] for field in stats])
        assert_exact(row, _stats_vector(alone[i]), what=what)
        assert_exact(histograms[i], alone_histograms[i], what=what)


def _stats_vector(stats):
    return np.array([np.float32(v) for v in stats], np.float32)


def test_tally_then_choose_with_knobs(run):
    # The telemetry's amax (from the tally) chooses what the point's own
    # amax chooses, ceiling 2**10, margin 2**4: amax 3 -> 3 * 2**(k+4) <=
    # 65504 -> k = 10, at the ceiling -> 2**10.
    def fn(g):
        stats, _ = tallies.statistics_of_tallies(tallies.tallies([[g]]), 0.01)
        return (
            choose(stats.amax[0], tf.constant(2.0**10), tf.constant(2.0**4)),
            choose(rule.amax_of(g), tf.constant(2.0**10), tf.constant(2.0**4)),
        )

    g = f16([[3.0, -1.0], [0.0, 2.0**-20]])
    from_tally, from_amax = run(fn, g)
    assert_exact(from_tally, 2.0**10)
    assert_exact(from_amax, 2.0**10)


# --------------------------------------------------------------------------
# log2_histogram
# --------------------------------------------------------------------------


def test_log2_histogram(run):
    # Ten float32 elements: 1 and 1.5 have exponent 0, -0.75 exponent -1,
    # 2**-20 exponent -20; 2**-30 lies below the lowest bin (-24) and
    # 65504 and 2**20 at or above the highest (15), so they land in the
    # end bins; 0, inf and NaN are in no bin. Fractions of all 10 elements.
    g = f32([0.0, 1.0, 1.5, 2.0**-20, 2.0**-30, 65504.0, 2.0**20, INF, NAN, -0.75])
    expected = np.zeros([len(tallies.HISTOGRAM_EXPONENTS)], np.float32)
    for exponent, fraction in [(0, 0.2), (-1, 0.1), (-20, 0.1), (-24, 0.1), (15, 0.2)]:
        expected[tallies.HISTOGRAM_EXPONENTS.index(exponent)] = fraction
    assert_exact(run(log2_histogram, g), expected)


def test_log2_histogram_of_float16_subnormals(run):
    # Every float16 subnormal magnitude k * 2**-24 has exponent
    # floor(log2 k) - 24: 2**-24 -> -24, 3 * 2**-24 -> -23, 2**-15 -> -15.
    g = f16([2.0**-24, 3 * 2.0**-24, 2.0**-15, 0.0])
    expected = np.zeros([len(tallies.HISTOGRAM_EXPONENTS)], np.float32)
    for exponent in (-24, -23, -15):
        expected[tallies.HISTOGRAM_EXPONENTS.index(exponent)] = 0.25
    assert_exact(run(log2_histogram, g), expected)


# --------------------------------------------------------------------------
# the percentile without a sort, against the exact one
# --------------------------------------------------------------------------


def _exact_quantile(values, rate):
    """The rate-quantile (lower interpolation) of the nonzero magnitudes,
    from a full sort in float64: the element of rank floor(rate * (n-1))."""
    magnitudes = np.sort(np.abs(np.asarray(values, np.float64)).ravel())
    magnitudes = magnitudes[magnitudes > 0]
    return magnitudes[int(math.floor(rate * (len(magnitudes) - 1) * (1 + 2.0**-40)))]


@pytest.mark.parametrize("rate", [0.0, 0.01, 0.29, 0.5, 0.99])
def test_percentile_is_the_exact_quantile_rounded_down(run, rate):
    """Magnitudes spread over 2**-24 .. 2**15 (log-normal, a third zeros,
    float16): the statistic is the sorted quantile rounded down to a power
    of two, so within one binary exponent of it, and exactly equal in every
    comparison with a power of two."""
    rng = np.random.default_rng(1)
    values = np.exp2(rng.normal(-6.0, 6.0, size=(300, 257))).astype(np.float16)
    values[rng.random(values.shape) < 0.33] = 0.0
    values *= rng.choice([-1.0, 1.0], size=values.shape).astype(np.float16)
    stats = run(lambda g: gradient_statistics(g, rate), tf.constant(values))
    assert_exact(stats.percentile, power_of_two_below(_exact_quantile(values, rate)))


def test_percentile_on_real_gradients(mixed):
    """The gradients a float16 Transformer's layers receive (loss x 2**-8,
    so that some of them are tiny): the same contract, for every variable's
    gradient and the default rate."""
    from tests import architectures

    case = next(c for c in architectures.CASES if c.name == "transformer")
    _, model = case.build_pair()
    x, y = case.data()
    with tf.GradientTape() as tape:
        loss = case.loss(y, model(x, training=True)) * 2.0**-8 * 2.0**15
    grads = tape.gradient(loss, model.trainable_variables)
    checked = 0
    for variable, g in zip(model.trainable_variables, grads):
        g = tf.convert_to_tensor(g)
        if not np.any(np.asarray(g)):
            continue
        stats = gradient_statistics(g, 0.01)
        expected = power_of_two_below(_exact_quantile(np.asarray(g), 0.01))
        assert float(stats.percentile) == expected, variable.path
        checked += 1
    assert checked >= 10


# --------------------------------------------------------------------------
# the per-step rule, against exact arithmetic
# --------------------------------------------------------------------------


def _exact_scale(amax, ceiling, margin, backoff, inherited):
    """The rule worked out in float64, where every product below is exact
    (float32 values times powers of two and a small integer backoff): the
    largest k with amax * backoff * margin * 2**k <= 65504, clipped to
    [-log2(inherited), log2(ceiling)]."""
    reach = float(np.float32(amax)) * backoff * margin
    k = math.floor(math.log2(F16_MAX / reach)) + 1
    while reach * 2.0**k > F16_MAX:
        k -= 1
    k = min(max(k, -int(math.log2(inherited))), int(math.log2(ceiling)))
    return 2.0**k


def test_the_per_step_rule_is_exact_at_every_boundary(run):
    """The quotient 65504 / reach is rounded in float32; the rule checks and
    halves, so the scale is exact for amaxes whose mantissas sit on either
    side of each boundary (65504 / 2**j, one ulp up and down), over the
    float16 range, with back-offs and inherited lifts."""
    amaxes, rows = [], []
    for j in range(-12, 30, 3):
        edge = np.float32(F16_MAX / 2.0**12 / 2.0**j)
        for value in (
            np.nextafter(edge, np.float32(0)), edge,
            np.nextafter(edge, np.float32(np.inf)), edge * np.float32(0.75),
        ):
            for backoff, inherited in ((1.0, 1.0), (3.0, 1.0), (1.0, 2.0**6)):
                amaxes.append(np.float32(value))
                rows.append((backoff, inherited))

    def fn(amax):
        return [
            choose(amax[i], 2.0**15, 2.0**12, b, t)
            for i, (b, t) in enumerate(rows)
        ]

    outputs = run(fn, tf.constant(np.array(amaxes, np.float32)))
    for amax, (backoff, inherited), out in zip(amaxes, rows, outputs):
        expected = _exact_scale(amax, 2.0**15, 2.0**12, backoff, inherited)
        assert_exact(out, expected, what=(float(amax), backoff, inherited))


def test_amax_of_pools_gradients_of_any_dtype(run):
    def fn(a, b):
        return rule.amax_of([a, b]), rule.amax_of(a)

    both, alone = run(fn, f16([1.0, -3.0, 0.5]), f32([[2.0, -2.5]]))
    assert_exact(both, 3.0)
    assert_exact(alone, 3.0)


# --------------------------------------------------------------------------
# the paper's rule, against numpy
# --------------------------------------------------------------------------


def _paper_numpy(g, rate, ceiling, margin, inherited=1.0, current=1.0):
    """The ALS paper's scale from numpy: the reciprocal of the `rate`
    quantile (numpy's `method="lower"`) of the nonzero magnitudes, the
    largest power of two at most that, then capped by safety and the
    clip; `current` when all are zero or one is not finite."""
    magnitudes = np.abs(np.asarray(g, np.float64)).ravel()
    if not np.all(np.isfinite(magnitudes)) or not np.any(magnitudes):
        return current
    q = np.percentile(magnitudes[magnitudes > 0], 100 * rate, method="lower")
    k = math.floor(math.log2(1.0 / q))
    while 2.0**k > 1.0 / q:
        k -= 1
    safe = _exact_scale(magnitudes.max(), 2.0**127, margin, 1.0, 2.0**126)
    k = min(k, int(math.log2(safe)))
    return 2.0 ** min(max(k, -int(math.log2(inherited))), int(math.log2(ceiling)))


def test_paper_scale_matches_numpy(run):
    rng = np.random.default_rng(0)
    log_uniform = np.exp2(rng.uniform(-26, 4, size=1000)) * rng.choice([-1, 1], 1000)
    sparse = np.where(rng.uniform(size=1000) < 0.7, 0.0, log_uniform)
    cases = [
        # (values, dtype, rate, ceiling, margin, inherited)
        (log_uniform, np.float16, 0.01, 2.0**15, 2.0**12, 1.0),
        (log_uniform, np.float32, 0.01, 2.0**15, 1.0, 1.0),
        (sparse, np.float16, 0.01, 2.0**15, 2.0**12, 1.0),
        (sparse * 2.0**-10, np.float32, 0.05, 2.0**15, 2.0**4, 1.0),
        (log_uniform * 2.0**8, np.float32, 0.01, 2.0**15, 2.0**12, 2.0**10),
        (np.arange(1.0, 101.0) * 2.0**-20, np.float32, 0.01, 2.0**10, 2.0**12, 1.0),
        (np.zeros(16), np.float16, 0.01, 2.0**15, 2.0**12, 1.0),
        ([1.0, np.inf, 2.0], np.float32, 0.01, 2.0**15, 2.0**12, 1.0),
    ]
    tensors = [tf.constant(np.asarray(v, d)) for v, d, *_ in cases]

    def fn(*gs):
        return [
            rule.choose_scale_paper(g, 1.0, c, m, r, 1.0, t)
            for g, (_, _, r, c, m, t) in zip(gs, cases)
        ]

    outputs = run(fn, *tensors)
    for i, ((values, dtype, rate, ceiling, margin, inherited), out) in enumerate(
        zip(cases, outputs)
    ):
        stored = np.asarray(values, dtype)  # what the tensor holds
        expected = _paper_numpy(stored, rate, ceiling, margin, inherited)
        assert_exact(out, expected, what=i)


def test_nonzero_quantile_matches_numpy(run):
    rng = np.random.default_rng(1)
    values = np.where(rng.uniform(size=777) < 0.3, 0.0, rng.normal(size=777))
    rates = (0.0, 0.01, 0.29, 0.5, 0.999)

    def fn(g):
        return [rule.nonzero_quantile(g, r) for r in rates]

    outputs = run(fn, f32(values))
    nonzero = np.abs(values[values != 0]).astype(np.float32)
    for rate, out in zip(rates, outputs):
        expected = np.percentile(nonzero, 100 * rate, method="lower")
        assert_exact(out, expected, what=rate)


# --------------------------------------------------------------------------
# telemetry samples
# --------------------------------------------------------------------------


def test_sample_is_small_odd_strided_and_whole_when_small(run):
    small = np.arange(100, dtype=np.float32)
    big = np.arange(64 * 1024, dtype=np.float32).reshape(64, 32, 32)

    def fn(a, b):
        return tallies.sample(a), tallies.sample(b)

    whole, strided = run(fn, f32(small), f32(big))
    assert_exact(whole, small)
    # 65536 elements, at most 4096: stride 16, made odd: 17.
    assert_exact(strided, np.arange(0, 64 * 1024, 17, dtype=np.float32))
    # An odd stride visits every residue of a power-of-two channel count.
    assert len(set((strided % 32).tolist())) == 32


def test_telemetry_tallies_count_each_points_samples_and_keep_the_exact_amax(run):
    """Three points at once (two samples of different dtypes and lengths,
    one, none): each row is `tallies` of that point's samples alone, with
    the exact amax given in place of the samples' (5.0 is off the stride-3
    sample of the first point's gradient)."""
    g = np.zeros(8193, np.float32)
    g[1] = 5.0
    g[3] = 2.0**-20
    other = np.array([0.0, -1.5, 2.0**-14, 3.0], np.float16)
    third = np.array([2.0**-24, 7.0, -7.0], np.float16)

    def fn(g, other, third, amaxes):
        samples = [[tallies.sample(g), other], [third], []]
        return tallies.telemetry_tallies(samples, amaxes), [
            tallies.tallies([s])[0] for s in samples
        ]

    amaxes = tf.constant([5.0, 7.0, 0.0])
    counts, alone = run(fn, f32(g), tf.constant(other), tf.constant(third), amaxes)
    assert counts.shape == (3, tallies.TALLY_SIZE)
    assert_exact(counts[:, 0], amaxes.numpy())
    for row, expected in zip(counts, alone):
        assert_exact(row[1:], np.asarray(expected)[1:])
    assert counts[0, 1:].sum() == len(range(0, 8193, 3)) + len(other)
    assert counts[2, 1:].sum() == 0
    stats, _ = tallies.statistics_of_tallies(counts[:1], 0.0)
    assert float(stats.percentile[0]) == 2.0**-20


def test_sample_with_an_unknown_batch_strides_through_the_first_examples():
    """A `fit` step traces its gradients with an unknown batch dimension:
    the sample then strides (by a constant) through the first four
    examples."""
    values = np.arange(8 * 64 * 64, dtype=np.float32).reshape(8, 64, 64)

    @tf.function(input_signature=[tf.TensorSpec([None, 64, 64], tf.float32)])
    def fn(g):
        return tallies.sample(g)

    # 4 * 4096 elements, at most 4096: stride 4, made odd: 5.
    expected = values[:4].ravel()[::5]
    assert_exact(fn(tf.constant(values)).numpy(), expected)


def test_amax_of_reads_every_sign_and_non_finite(run):
    """The bit-pattern amax against numpy's max |g|, per dtype: positive
    and negative maxima, all-negative, zeros and signed zeros, subnormals,
    inf and NaN on either side."""
    cases = [
        [1.0, -3.0, 2.0],
        [-1.0, -0.5],
        [0.5, 0.25],
        [0.0, -0.0],
        [2.0**-24, -(2.0**-20)],
        [1.0, -INF],
        [INF, -2.0],
        [1.0, -NAN],
        [NAN, 5.0],
    ]
    for dtype in (tf.float16, tf.bfloat16, tf.float32):
        tensors = [tf.constant(c, dtype) for c in cases]
        outputs = run(lambda *gs: [rule.amax_of(g) for g in gs], *tensors)
        for values, t, out in zip(cases, tensors, outputs):
            stored = np.abs(t.numpy().astype(np.float32))
            expected = np.float32(np.nan if np.isnan(stored).any() else stored.max())
            assert_exact(out, expected, what=(dtype.name, values))


def test_amaxes_of_gives_each_tensors_amax_of_any_dtype(run):
    """`amaxes_of` (the optimizer's one read of every gradient) converts
    each dtype's maxima together: each tensor's value must still be its own
    `amax_of`, exactly, in the order given, whatever dtypes and non-finite
    values sit between them; None gives 0."""
    cases = [
        ([1.0, -3.0, 2.0], tf.float32),
        ([2.0**-24, -(2.0**-20)], tf.float16),
        ([1.0, -NAN], tf.float32),
        ([0.0, -0.0], tf.bfloat16),
        ([INF, -2.0], tf.float16),
        ([0.5, -0.25], tf.float64),
        ([-7.0], tf.float32),
    ]
    tensors = [tf.constant(values, dtype) for values, dtype in cases]

    def fn(*gs):
        given = list(gs)
        given.insert(2, None)
        return rule.amaxes_of(given), [rule.amax_of(g) for g in gs]

    together, alone = run(fn, *tensors)
    assert_exact(together[2], 0.0)
    del together[2]
    assert len(together) == len(cases)
    for case, got, want in zip(cases, together, alone):
        assert_exact(got, want, what=case)


def test_scale_within_reads_a_limit_given_as_its_bit_pattern(run):
    """The backward pass hands the limit as its bit pattern; the scale must
    be the one `scale_within` gives for the limit itself."""
    amaxes = f32([3.0, 2.0**-20, 0.0, 2.0**10, NAN])
    limits = f32([16.0, 16.0, 16.0, 1.0, 16.0])

    def fn(a, l):
        return (
            rule.scale_within(a, rule.bits_of(l), 2.0**15, 64.0),
            rule.scale_within(a, l, 2.0**15, 64.0),
        )

    got, want = run(fn, amaxes, limits)
    assert_exact(got, want)
