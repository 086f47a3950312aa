"""KerasTuner: a `HyperModel` whose `build` returns an instrumented model.

KerasTuner clears the Keras session before every trial, and with it the
global dtype policy, so the policy must be set inside `build`; a `build`
that does not trains in float32 and gets tf_als's warning naming that
cause and the fix.
"""

import keras
import keras_tuner
import numpy as np
import pytest

import tf_als


class _HyperMLP(keras_tuner.HyperModel):
    """Two Dense layers whose width is the hyper-parameter, instrumented,
    with `mixed_float16` set where KerasTuner cannot undo it (`policy`)."""

    def __init__(self, policy="mixed_float16"):
        super().__init__()
        self.policy = policy

    def build(self, hp):
        if self.policy is not None:
            keras.mixed_precision.set_global_policy(self.policy)
        inputs = keras.Input((8,))
        x = keras.layers.Dense(hp.Choice("units", [4, 16]), activation="relu")(inputs)
        outputs = keras.layers.Dense(1, dtype="float32")(x)
        model = tf_als.instrument(keras.Model(inputs, outputs))
        model.compile(
            optimizer=tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-2)),
            loss="mse",
        )
        return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    return x, (x @ rng.normal(size=(8, 1))).astype("float32")


def test_random_search_trains_instrumented_models_and_returns_the_best(tmp_path):
    x, y = _data()
    tuner = keras_tuner.RandomSearch(
        _HyperMLP(), objective="loss", max_trials=2, seed=0,
        directory=str(tmp_path), project_name="search", overwrite=True,
    )
    tuner.search(x, y, epochs=2, batch_size=16, verbose=0)
    trials = tuner.oracle.get_best_trials(2)
    assert len(trials) == 2
    assert {t.hyperparameters.get("units") for t in trials} == {4, 16}
    best = tuner.get_best_models(1)[0]
    assert isinstance(best, tf_als.InstrumentedModel)
    # The best model predicts with the weights its trial trained: its loss
    # on the training data is the trial's last recorded loss, to the
    # float32 rounding of a mean over 64 values (relative 1e-5; `fit`'s
    # recorded loss is the epoch mean while weights moved, so compare with
    # `evaluate`'s own figure, which the trial's score is not).
    predictions = best.predict(x, verbose=0)
    assert predictions.shape == (64, 1) and np.all(np.isfinite(predictions))
    mse = float(np.mean((predictions - y) ** 2))
    np.testing.assert_allclose(best.evaluate(x, y, verbose=0), mse, rtol=1e-3)
    assert mse < float(np.mean(y**2))  # it learned something


def test_a_build_that_leaves_the_policy_to_the_session_is_told_why(tmp_path):
    """The trial's model is built under the float32 policy KerasTuner left:
    it trains (as the plain model would: no points), and the warning names
    the cause and the fix."""
    x, y = _data()
    keras.mixed_precision.set_global_policy("mixed_float16")  # cleared per trial
    tuner = keras_tuner.RandomSearch(
        _HyperMLP(policy=None), objective="loss", max_trials=1, seed=0,
        directory=str(tmp_path), project_name="search", overwrite=True,
        max_consecutive_failed_trials=1,
    )
    with pytest.warns(UserWarning, match="computes nothing in float16") as caught:
        tuner.search(x, y, epochs=1, batch_size=16, verbose=0)
    message = next(str(w.message) for w in caught if "float16" in str(w.message))
    assert "KerasTuner clears the session" in message
    assert "first thing in `build`" in message
    best = tuner.get_best_models(1)[0]
    assert tf_als.scales(best) == {}
    assert best.layers[1].compute_dtype == "float32"
