"""`diagnose`, the first-batch check and the storm path name the same
layer for the same batch and weights (one search,
`preflight.failing_layers`), on a failure whose forward pass is finite:
a weightless noisy-OR pooling whose clamp `1 - 1e-6` rounds to 1.0 in
float16 (fastino-ai/GLiNER2#155). A saturated instance probability then
gives `log1p(-1) = -inf`, and the backward pass `0 * inf = NaN` at every
loss scale; float32 holds `1 - 1e-6` and stays finite."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tf_als._src.failures import preflight
from tf_als._src.failures import promote

layers = keras.layers
pytestmark = pytest.mark.usefixtures("mixed")


class NoisyOr(layers.Layer):
    """A bag's probability from its instances' (last axis): 1 - prod(1 - p),
    through logs, with the clamp the thread used."""

    def call(self, p):
        p = keras.ops.minimum(p, keras.ops.cast(1.0 - 1e-6, p.dtype))
        return 1.0 - keras.ops.exp(keras.ops.sum(keras.ops.log1p(-p), axis=-1))


def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 16))
    x = layers.Dense(16, activation="relu", name="hidden")(inputs)
    x = layers.Dense(1, activation="sigmoid", name="instance_prob")(x)
    x = layers.Reshape((8,))(x)
    model = keras.Model(inputs, NoisyOr(name="noisy_or")(x))
    # Saturate some instances: sigmoid(12) rounds to 1.0 in float16.
    model.get_layer("instance_prob").bias.assign([12.0])
    return model


def _batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8, 16)).astype("float32")
    y = rng.integers(0, 2, size=(16, 1)).astype("float32")
    return x, y


def _loss(x, y, y_pred, sample_weight):
    bag = keras.ops.cast(keras.ops.reshape(y_pred, (-1, 1)), "float32")
    return keras.ops.mean(keras.losses.binary_crossentropy(y, bag))


def test_the_failure_is_float16s():
    """Guards the test below: finite forward, NaN gradients in float16;
    finite gradients in float32 on the same weights."""
    x, y = _batch()
    model = _model()
    with tf.GradientTape() as tape:
        value = _loss(x, y, model(x), None)
    assert np.isfinite(float(value))
    grads = tape.gradient(value, model.trainable_weights)
    assert not all(np.isfinite(np.asarray(g)).all() for g in grads)
    for layer in model.layers:
        layer.dtype_policy = "float32"
    with tf.GradientTape() as tape:
        value = _loss(x, y, model(x), None)
    grads = tape.gradient(value, model.trainable_weights)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_diagnose_and_the_check_name_the_same_layer():
    x, y = _batch()
    report = tf_als.diagnose(
        _model(),
        x,
        y,
        loss=lambda y, y_pred: keras.losses.binary_crossentropy(
            y, keras.ops.reshape(keras.ops.cast(y_pred, "float32"), (-1, 1))
        ),
        verbose=False,
    )
    model = tf_als.instrument(_model())
    outcome = preflight.check(model, (x, y, None), _loss, scale=2.0**15, step=0)
    assert [p.layer for p in outcome.promotions] == ["noisy_or"]
    assert promote.kind(outcome.promotions[0].reason) == promote.BACKWARD
    assert [layer for layer, _ in report.float16_failures] == ["noisy_or"]
    # The report leads with it, not with the data.
    assert report.non_finite.startswith("Layer 'noisy_or' fails in float16"), report
    assert "labels" not in report.non_finite
