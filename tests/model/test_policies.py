"""One script for float16 and bfloat16 machines: under a policy with no
float16 compute (`float32`, `mixed_bfloat16`), `tf_als.instrument` gives a
model with no scaling points that trains exactly as the plain model, and
says so once; an `AdaptiveLossScaleOptimizer` then is Keras's
`LossScaleOptimizer`, and a plain optimizer stays plain.

"Exactly" is bitwise: the same weights, the same batches in the same
order and the same optimizer arithmetic leave nothing to differ, so the
tolerance is 0.
"""

import warnings

import keras
import numpy as np
import pytest

import tf_als

POLICIES = ["float32", "mixed_bfloat16"]


class Net(keras.Model):
    """A subclassed model, opened when instrumented under float16."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.head = keras.layers.Dense(1, dtype="float32")

    def call(self, x):
        return self.head(self.hidden(x))


def _functional():
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(x))


def _subclassed():
    model = Net()
    model(np.zeros((1, 8), "float32"))
    return model


BUILDS = {"functional": _functional, "subclassed": _subclassed}


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    return x, (x @ rng.normal(size=(8, 1))).astype("float32")


def _trained(model, optimizer):
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(*_data(), batch_size=16, epochs=2, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.weights]


def _built(build):
    keras.utils.set_random_seed(0)
    return build()


@pytest.mark.parametrize("build", list(BUILDS), ids=list(BUILDS))
@pytest.mark.parametrize("policy", POLICIES)
def test_no_float16_trains_exactly_as_the_plain_model(policy, build):
    keras.mixed_precision.set_global_policy(policy)
    plain = _built(BUILDS[build])
    expected = _trained(plain, keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = tf_als.instrument(_built(BUILDS[build]))
        actual = _trained(
            model, tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01))
        )
    messages = [str(w.message) for w in caught]
    said = [m for m in messages if "computes nothing in float16" in m]
    assert len(said) == 1 and f"policy is {policy!r}" in said[0], messages
    assert not [m for m in messages if "not instrumented" in m], messages
    assert isinstance(model, tf_als.InstrumentedModel)
    assert tf_als.scales(model) == {} and tf_als.points(model) == []
    assert [w.dtype for w in expected] == [w.dtype for w in actual]
    for e, a in zip(expected, actual, strict=True):
        np.testing.assert_array_equal(a, e)
    assert not np.array_equal(expected[0], np.asarray(_built(BUILDS[build]).weights[0]))


@pytest.mark.parametrize("policy", POLICIES)
def test_a_plain_optimizer_stays_plain(policy):
    keras.mixed_precision.set_global_policy(policy)
    expected = _trained(_built(_functional), keras.optimizers.SGD(0.01))
    with pytest.warns(UserWarning, match="computes nothing in float16"):
        model = tf_als.instrument(_built(_functional))
    actual = _trained(model, keras.optimizers.SGD(0.01))
    assert type(model.optimizer) is keras.optimizers.SGD
    for e, a in zip(expected, actual, strict=True):
        np.testing.assert_array_equal(a, e)


def test_only_a_float32_policy_is_told_how_to_train_in_float16():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    with pytest.warns(UserWarning) as bfloat16:
        tf_als.instrument(_functional())
    keras.mixed_precision.set_global_policy("float32")
    with pytest.warns(UserWarning) as float32:
        tf_als.instrument(_functional())
    assert "KerasTuner" not in str(bfloat16[0].message)
    assert "first thing in `build`" in str(float32[0].message)


def test_scale_history_and_the_guard_run_on_a_model_without_points(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    with pytest.warns(UserWarning, match="computes nothing in float16"):
        model = tf_als.instrument(_functional())
    model.compile(
        optimizer=tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01)),
        loss="mse",
    )
    history = tf_als.callbacks.ScaleHistory(log_dir=str(tmp_path))
    model.fit(*_data(), batch_size=16, epochs=1, verbose=0, callbacks=[history])
    assert history.skipped_steps == 0
    assert int(model.optimizer.iterations.numpy()) == 4
