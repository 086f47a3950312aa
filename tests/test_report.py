"""`tf_als.diagnose`: per-layer underflow and error of Keras's loss scaling
and of tf_als against float32, and where gradients turn non-finite."""

import keras
import numpy as np
import pytest
from sklearn.datasets import load_digits

import tf_als
from tests import architectures
from tests import gradients
from tests import test_underflow

layers = keras.layers


def _digits_batch():
    digits = load_digits()
    x = (digits.data[:64] / 16.0).astype("float32")
    return x, digits.target[:64]


def test_flags_exactly_the_layers_that_underflow(mixed, capsys):
    """The 16-layer sigmoid MLP of test_underflow at initialisation: the
    report's Keras underflow per layer equals what the inner optimizer of a
    real LossScaleOptimizer receives (computed independently here), the
    flagged layers are those above 1%, and tf_als leaves none."""
    model = test_underflow._build()
    x, y = _digits_batch()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    report = tf_als.diagnose(model, x, y, loss=loss)
    assert "tf_als precision report" in capsys.readouterr().out

    keras.mixed_precision.set_global_policy("float32")
    reference = test_underflow._build()
    reference.set_weights(model.get_weights())
    expected = gradients.float32_gradients(reference, x, y, loss)
    keras.mixed_precision.set_global_policy("mixed_float16")
    optimizer = keras.optimizers.LossScaleOptimizer(gradients.GradientRecorder())
    received, _ = gradients.applied_gradients(model, optimizer, x, y, loss)
    assert report.keras_loss_scale == float(optimizer.dynamic_scale)

    flagged = []
    for row, layer in zip(report.rows, [l for l in model.layers if l.weights]):
        assert row.layer == layer.name
        i = [v.path for v in model.trainable_variables].index(layer.kernel.path)
        got = np.concatenate([received[i].ravel(), received[i + 1].ravel()])
        truth = np.concatenate([expected[i].ravel(), expected[i + 1].ravel()])
        flushed = float(np.mean((got == 0) & (truth != 0)))
        assert row.keras_underflow == pytest.approx(flushed, abs=1e-12)
        if flushed > 0.01:
            flagged.append(row.point)
        assert row.als_underflow <= 0.01
    assert flagged and report.underflowing(0.01) == flagged
    assert report.non_finite is None


def test_names_the_layer_whose_gradient_overflows(mixed):
    """`shrink` makes tiny activations and `boom` (kernel x 2000) brings
    them back, so the forward pass is tame; backwards, boom multiplies the
    gradient by its large kernel, and at the starting scale 2**15 its input
    gradient overflows float16 while its incoming gradient and its own
    weight gradient stay finite."""
    inputs = keras.Input((16,))
    x = layers.Dense(32, activation="tanh", name="first")(inputs)
    x = layers.Dense(32, name="shrink")(x)
    x = layers.Dense(32, activation="tanh", name="boom")(x)
    outputs = layers.Dense(4, dtype="float32", name="head")(x)
    model = keras.Model(inputs, outputs)
    shrink, boom = model.get_layer("shrink"), model.get_layer("boom")
    shrink.kernel.assign(shrink.kernel * 1e-3)
    boom.kernel.assign(boom.kernel * 2000.0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16)).astype("float32")
    y = rng.integers(0, 4, size=(32,))
    assert np.all(np.isfinite(np.asarray(model(x))))
    report = tf_als.diagnose(
        model,
        x,
        y,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        verbose=False,
    )
    assert report.non_finite is not None
    assert report.non_finite.startswith("layer 'boom'")
    assert "input gradient" in report.non_finite
    assert report.keras_loss_scale < 2.0**15  # Keras backed off to fit.
    assert "non-finite gradients: layer 'boom'" in str(report)


@pytest.mark.slow  # ~30 s: diagnose halves the scale 64 times before giving up
def test_names_the_loss_when_labels_are_not_finite(mixed):
    model = test_underflow._build()
    x, _ = _digits_batch()
    y = np.full((64, 10), np.nan, "float32")
    report = tf_als.diagnose(
        model, x, y, loss=keras.losses.CategoricalCrossentropy(from_logits=True),
        verbose=False,
    )
    assert report.non_finite.startswith("before the first scaling point")


def test_works_on_an_instrumented_model_without_changing_it(mixed):
    model = tf_als.instrument(test_underflow._build())
    for point in model.scaling_points:
        point.scale.assign(4.0)
    x, y = _digits_batch()
    model.compile(
        optimizer=tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD()),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    report = tf_als.diagnose(model, x, y, verbose=False)  # the compiled loss
    assert len(report.rows) == len(model.scaling_points)
    assert set(tf_als.scales(model).values()) == {4.0}


def test_model_compiled_with_unregistered_objects(mixed):
    """The copies diagnose makes are not compiled: a model compiled with a
    loss class Keras cannot deserialise still works, and stays compiled."""

    class UnregisteredLoss(keras.losses.Loss):
        def call(self, y_true, y_pred):
            return keras.losses.sparse_categorical_crossentropy(
                y_true, y_pred, from_logits=True
            )

    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10, dtype="float32")(hidden))
    model.compile(keras.optimizers.SGD(), UnregisteredLoss())
    x, y = _digits_batch()
    report = tf_als.diagnose(model, x, y, verbose=False)
    assert [r.layer for r in report.rows] == [l.name for l in model.layers if l.weights]
    assert model.compiled


def test_needs_a_loss(mixed):
    model = test_underflow._build()
    x, y = _digits_batch()
    with pytest.raises(ValueError, match="loss="):
        tf_als.diagnose(model, x, y)


def test_subclassed_model_is_refused_with_the_way_out(mixed):
    model = architectures.subclassed()
    x, y = architectures.CASES[0].data()
    with pytest.raises(TypeError, match="diagnose.*subclassed.*Functional"):
        tf_als.diagnose(model, x, y, loss="sparse_categorical_crossentropy")


def test_underflowing_checks_its_scaling_argument(mixed):
    report = tf_als.report.Diagnosis(
        rows=(), keras_loss_scale=1.0, als_loss_scale=1.0, non_finite=None
    )
    with pytest.raises(ValueError, match='`scaling` must be "keras" or "tf_als"; received \'als\''):
        report.underflowing(scaling="als")
