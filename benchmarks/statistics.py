"""Cost of a scale update's statistics: tf_als's linear passes against the
sort they replace, side by side in one process.

For float16 gradients of growing size (log-normal magnitudes, a third
zeros), times `tallies.tallies` (amax and a count per binary exponent,
what a scaling point runs on an update step) followed by
`tallies.statistics_of_tallies` (the percentile, fractions and
histogram derived from it), and the same statistics with the
percentile from a full sort (`tfp.stats.percentile` on the nonzero
magnitudes, what tf_als ran before), each compiled with `tf.function`, XLA
off and on; and reports how far the new percentile is from the sorted one,
in binary exponents (it is the sorted one rounded down to a power of two).

    python benchmarks/statistics.py [--repeats 20]
"""

import argparse
import sys
import time

import numpy as np
import tensorflow as tf
import tensorflow_probability as tfp

sys.path.insert(0, ".")
from tf_als._src.scaling import tallies  # noqa: E402

SIZES = (2**14, 2**17, 2**20, 2**22)


def _sorted_statistics(g, rate):
    """The percentile from a full sort (lower interpolation, rank
    floor(rate * (nonzero-1))), plus amax and the histogram."""
    magnitudes = tf.abs(tf.cast(tf.reshape(g, [-1]), tf.float32))
    is_zero = tf.equal(magnitudes, 0.0)
    size = tf.cast(tf.size(magnitudes), tf.float64)
    nonzero = size - tf.reduce_sum(tf.cast(is_zero, tf.float64))
    masked = tf.where(is_zero, tf.constant(float("inf")), magnitudes)
    index = tf.floor(rate * tf.maximum(nonzero - 1.0, 0.0))
    q = tf.minimum(100.0 * (index + 0.5) / tf.maximum(size - 1.0, 1.0), 100.0)
    percentile = tfp.stats.percentile(masked, q, interpolation="lower")
    _, histograms = tallies.statistics_of_tallies(tallies.tallies([g]), 0.0)
    histogram = histograms[0]
    return tf.concat(
        [tf.stack([percentile, tf.reduce_max(magnitudes)]), histogram], 0
    )


def _linear_statistics(g, rate):
    """tf_als's: the tally, then the statistics derived from it."""
    stats, histograms = tallies.statistics_of_tallies(tallies.tallies([g]), rate)
    return tf.concat([tf.stack([stats.percentile[0], stats.amax[0]]), histograms[0]], 0)


def _time(function, g, repeats):
    function(g)  # trace and compile
    start = time.perf_counter()
    for _ in range(repeats):
        result = function(g)
    np.asarray(result)
    return (time.perf_counter() - start) / repeats


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    print("| XLA | elements | sorted (ms) | linear (ms) | ratio | percentile: sorted / linear |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for jit in (False, True):
        linear = tf.function(lambda g: _linear_statistics(g, 0.01), jit_compile=jit)
        sort = tf.function(lambda g: _sorted_statistics(g, 0.01), jit_compile=jit)
        for size in SIZES:
            values = np.exp2(rng.normal(-8.0, 5.0, size)).astype(np.float16)
            values[rng.random(size) < 0.33] = 0
            g = tf.constant(values)
            old, new = _time(sort, g, args.repeats), _time(linear, g, args.repeats)
            ratio = float(sort(g)[0]) / float(linear(g)[0])
            print(
                f"| {'on' if jit else 'off'} | {size:,} | {1e3 * old:.2f} | "
                f"{1e3 * new:.2f} | {new / old:.2f} | {ratio:.3f} |"
            )


if __name__ == "__main__":
    main()
