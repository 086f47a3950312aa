"""Underflow rescue: where one global loss scale cannot serve every layer,
per-layer scales can.

How the case is built: a 16-layer MLP with sigmoid activations (64 units,
Keras's default glorot_uniform kernels and zero biases), the textbook
vanishing-gradient network, trained on scikit-learn's digits. Each sigmoid
layer shrinks the backpropagated gradient about fourfold (sigmoid' <= 1/4),
so in float32 the kernel gradients span from ~1e-10 (first layer) to ~1
(last): a spread of ~2**33, wider than float16's normal range (2**30).

1. Keras's `LossScaleOptimizer` trains it for 6 epochs, 168 steps (`fit`
   with XLA, Adam). Its scale never overflows, so it stays where it
   starts, 2**15 (it would double only after 2000 overflow-free steps).
2. At those trained weights and that scale, on a fresh batch, the first
   layer loses most of its kernel gradient to underflow: elements that are
   nonzero in float32 arrive as exact zeros. Measured: 77%, 50% and 12% of
   the first three layers' kernel gradients (80% and 24% at initialisation);
   the test asserts more than 25% for the worst layer.
3. The same weights instrumented, one tf_als step (its first: the points
   choose from the very gradients they scale): at most 1% of any layer's
   kernel gradient is flushed (measured:
   0% in every layer), and each scaling point records at most 1% zeros in
   the gradient that reaches it.
"""

import keras
import numpy as np
from sklearn.datasets import load_digits

import tf_als
from tests import gradients

DEPTH = 16
BATCH = 64


def _build():
    inputs = keras.Input((64,))
    x = inputs
    for _ in range(DEPTH):
        x = keras.layers.Dense(64, activation="sigmoid")(x)
    outputs = keras.layers.Dense(10, dtype="float32")(x)
    return keras.Model(inputs, outputs)


def _flushed(gradient, reference):
    """Fraction of elements that are exact zeros but nonzero in float32."""
    return float(np.mean((gradient == 0) & (reference != 0)))


def test_per_layer_scales_rescue_what_one_global_scale_flushes(mixed):
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    # 1. Real training with Keras's loss scaling.
    model = _build()
    # With XLA, as on a GPU by default: the 168 steps take 8 s on the CPU
    # instead of 17 s (Keras turns XLA off there), and the scale still
    # never moves, so the weights it reaches are what the test needs.
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, jit_compile=True)
    model.fit(x[:-BATCH], y[:-BATCH], batch_size=BATCH, epochs=6, verbose=0)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    settled = float(keras.ops.convert_to_numpy(model.optimizer.dynamic_scale))
    trained = model.get_weights()

    # Float32 gradients of the trained weights on a held-out batch.
    batch_x, batch_y = x[-BATCH:], y[-BATCH:]
    keras.mixed_precision.set_global_policy("float32")
    reference = _build()
    reference.set_weights(trained)
    expected = gradients.float32_gradients(reference, batch_x, batch_y, loss)
    kernels = slice(0, None, 2)
    assert all(np.mean(g != 0) > 0.5 for g in expected[kernels])

    # 2. Keras's LossScaleOptimizer at the scale it settled at.
    keras.mixed_precision.set_global_policy("mixed_float16")
    baseline = _build()
    baseline.set_weights(trained)
    keras_optimizer = keras.optimizers.LossScaleOptimizer(
        gradients.GradientRecorder(), initial_scale=settled
    )
    keras_grads, _ = gradients.applied_gradients(
        baseline, keras_optimizer, batch_x, batch_y, loss
    )
    keras_flushed = [
        _flushed(g, r) for g, r in zip(keras_grads[kernels], expected[kernels])
    ]
    assert max(keras_flushed) > 0.25, keras_flushed

    # 3. tf_als on the same weights: its first step, on the scales its
    # points chose from that step's gradients (telemetry_interval 1: the
    # step's record shows what reached each point under them).
    instrumented = tf_als.instrument(baseline)
    optimizer = tf_als.AdaptiveLossScaleOptimizer(
        gradients.GradientRecorder(), initial_scale=settled, telemetry_interval=1
    )
    als_grads, steps = gradients.applied_gradients(
        instrumented, optimizer, batch_x, batch_y, loss
    )
    assert steps == 1
    als_flushed = [
        _flushed(g, r) for g, r in zip(als_grads[kernels], expected[kernels])
    ]
    assert max(als_flushed) <= 0.01, als_flushed
    recorded = [p.read() for p in instrumented.scaling_points]
    assert all(r["last_update"] == 0 for r in recorded)
    assert max(r["zero_fraction"] for r in recorded) <= 0.01
    # The rescue is the per-layer scales' doing: the global scale is the
    # one Keras settled at, and deep layers carry cumulative scales > 1.
    assert float(keras.ops.convert_to_numpy(optimizer.dynamic_scale)) == settled
    assert recorded[0]["cumulative_scale"] > 1.0
