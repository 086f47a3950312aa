"""Exact power-of-two arithmetic on float32 tensors.

Scales in tf_als are powers of two so that applying or removing one never
rounds. `log(x) / log(2)` and `pow(2, e)` are not exact on every backend (XLA
lowers `pow` to `exp(y * log(x))`), so both directions work on the float32
bit pattern instead: the exponent field is the floor of log2 for every
normal float32, and writing an exponent field gives 2**e exactly.
"""

import tensorflow as tf

_MANTISSA_BITS = 23
_EXPONENT_BIAS = 127
_EXPONENT_MASK = 0x7F800000
# float32 normal exponents: 2**-126 .. 2**127.
MIN_EXPONENT = -126
MAX_EXPONENT = 127


def floor_log2(x):
    """Returns floor(log2(x)) as int32 for positive, normal float32 `x`.

    Zero, subnormal, negative and non-finite inputs give meaningless values;
    callers mask them out first.

    >>> floor_log2(tf.constant([1.0, 0.75, 2.0**-14])).numpy()
    array([  0,  -1, -14], dtype=int32)
    """
    bits = tf.bitcast(tf.cast(x, tf.float32), tf.int32)
    return tf.bitwise.right_shift(bits, _MANTISSA_BITS) - _EXPONENT_BIAS


def floor_pow2(x):
    """The largest power of two <= `x` (float32), for positive normal
    float32 `x`: its bit pattern with the mantissa cleared. inf stays inf;
    zero and subnormals give 0.

    >>> floor_pow2(tf.constant([1.0, 0.75, 65504.0, 3.0])).numpy()
    array([1.0000e+00, 5.0000e-01, 3.2768e+04, 2.0000e+00], dtype=float32)
    """
    bits = tf.bitcast(tf.cast(x, tf.float32), tf.int32)
    return tf.bitcast(tf.bitwise.bitwise_and(bits, _EXPONENT_MASK), tf.float32)


def pow2(exponent):
    """Returns 2**exponent as float32, exactly; `exponent` is clipped to the
    float32 normal range [-126, 127].

    >>> pow2(tf.constant([0, 3, -14])).numpy()
    array([1.0000000e+00, 8.0000000e+00, 6.1035156e-05], dtype=float32)
    """
    exponent = tf.clip_by_value(
        tf.cast(exponent, tf.int32), MIN_EXPONENT, MAX_EXPONENT
    )
    bits = tf.bitwise.left_shift(exponent + _EXPONENT_BIAS, _MANTISSA_BITS)
    return tf.bitcast(bits, tf.float32)
