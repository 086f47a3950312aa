"""A point's scale keeps the weight gradients it produces within float16.

A convolution's bias gradient sums the gradient it receives over batch x
positions, so it can overflow where the received gradient keeps its
margin below float16's maximum (issue 39: a U-Net skipped steps that
Keras's single scale did not). Each float16 point measures its gain, its
weight gradients' amax over its received gradient's, on every step
(`update.write_gains`), and the first-batch check measures it before the
first step; the point's next scale keeps the weight gradients
`rule.PRODUCED_MARGIN` below float16's maximum (`rule.produced_headroom`).

The model here is three 1x1 convolutions over 64x64 positions, batch 8:
2**15 terms in each bias gradient, most of one sign (the targets sit above
the outputs nearly everywhere). Under Keras's global scale 2**15 the
largest weight gradient is about 2**14; lifting the received gradient to
65504 / 2**12 without the gain takes it past 65504 (the first step
without the first-batch check).
"""

import keras
import numpy as np
import tensorflow as tf

import tf_als
from tf_als._src.scaling import rule

SIZE, BATCH, STEPS = 64, 8, 3


def _model():
    inputs = keras.Input((SIZE, SIZE, 2))
    x = keras.layers.Conv2D(4, 1, name="wide_1")(inputs)
    x = keras.layers.Conv2D(4, 1, name="wide_2")(x)
    outputs = keras.layers.Conv2D(1, 1, dtype="float32", name="head")(x)
    return keras.Model(inputs, outputs)


def _batches():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, SIZE, SIZE, 2)).astype("float32")
    y = (0.5 + 0.1 * rng.random((STEPS * BATCH, SIZE, SIZE, 1))).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def _fit(instrumented, **optimizer_kwargs):
    """(skipped steps, final global scale, model) of `STEPS` steps of SGD
    on a mean squared error, from seed 0."""
    keras.utils.set_random_seed(0)
    model = _model()
    inner = keras.optimizers.SGD(1e-3)
    if instrumented:
        model = tf_als.instrument(model)
        optimizer = tf_als.AdaptiveLossScaleOptimizer(
            inner, max_consecutive_skips=None, **optimizer_kwargs
        )
    else:
        optimizer = keras.optimizers.LossScaleOptimizer(inner)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    model.fit(_batches(), epochs=1, verbose=0, shuffle=False)
    applied = int(inner.iterations.numpy())
    return STEPS - applied, float(optimizer.dynamic_scale.numpy()), model


def test_weight_gradient_sums_skip_no_step_where_keras_skips_none(mixed):
    keras_skipped, keras_scale, _ = _fit(instrumented=False)
    assert (keras_skipped, keras_scale) == (0, 2.0**15)  # The premise.
    skipped, scale, model = _fit(instrumented=True)
    assert (skipped, scale) == (0, 2.0**15)
    # The bound did the work: the float16 points measured gains past the
    # 2**9 at which they start to count (2**12-2**13 here, near the 2**15
    # terms of a bias sum), and the float32 head, whose sums cannot
    # overflow float16, none.
    gains = dict(zip(model.scaling_state.point_names, model.scaling_state.gains.numpy()))
    assert gains["wide_1"] > 2.0**10 and gains["wide_2"] > 2.0**10, gains
    assert gains["head"] == 0.0, gains


def test_the_first_batch_check_measures_the_gains_before_step_0(mixed):
    # Without the check (promote_on_storm=False) the first step lifts
    # without knowing the gains and overflows once; the steps after it
    # know them. With the check, no step is lost.
    skipped, scale, _ = _fit(instrumented=True, promote_on_storm=False)
    assert (skipped, scale) == (1, 2.0**14)
    skipped, scale, _ = _fit(instrumented=True)
    assert (skipped, scale) == (0, 2.0**15)


def test_an_overflowing_weight_gradient_sends_its_point_back_to_keras_scale():
    # A point's gain is inf after a step whose weight gradient overflowed
    # while its received gradient did not: its next scale is 1 / T_out,
    # Keras's global scale alone. One measurement later it is finite again.
    limit = rule.produced_headroom(rule.headroom(2.0**12), float("inf"), 2.0**12)
    assert float(rule.scale_within(0.5, limit, 2.0**15, 8.0)) == 1 / 8
    assert float(rule.held_gain(2.0**10, float("inf"))) == 2.0**10

