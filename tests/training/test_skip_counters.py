"""The skip counters (`training.skips`), step by step: crafted finite and
non-finite gradients through `AdaptiveLossScaleOptimizer.apply` (eager, on
two plain variables), and the counters and the global scale S read after
every step. Everything compared is an integer or a power of two, so the
comparisons are exact."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tf_als._src.scaling import rule

INF = float("inf")

# (second gradient's value, then after the step: consecutive_skips,
# window_steps, window_skips, S). max_consecutive_skips=2: a window is 4
# steps; never 2 skips in a row, so the run never stops.
SCRIPT = [
    (INF, 1, 1, 1, 8.0),
    (1.0, 0, 2, 1, 8.0),
    (INF, 1, 3, 2, 4.0),  # 2 skips in the window: warned, once
    (1.0, 0, 4, 2, 4.0),
    (INF, 1, 1, 1, 2.0),  # the window was full: a new one
    (1.0, 0, 2, 1, 2.0),
    (INF, 1, 3, 2, 1.0),  # frequent again: already warned
]


def _optimizer(**kwargs):
    optimizer = tf_als.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=0.5), dynamic_growth_steps=1000, **kwargs
    )
    variables = [keras.Variable(np.ones(3, np.float32)), keras.Variable(np.ones(2, np.float32))]
    optimizer.build(variables)
    return optimizer, variables


@pytest.fixture(autouse=True)
def _plain_variables_warn_once():
    # The variables belong to no instrumented model: the optimizer says so.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "AdaptiveLossScaleOptimizer .* not instrumented")
        yield


def _step(optimizer, variables, value, loss=1.0):
    """One step: gradients of ones, the second variable's all `value`."""
    optimizer.scale_loss(tf.constant(loss))
    grads = [tf.ones(3), tf.fill([2], value)]
    optimizer.apply(grads, variables)


def test_counters_after_every_step():
    optimizer, variables = _optimizer(initial_scale=16.0, max_consecutive_skips=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for number, (value, consecutive, steps, skipped, scale) in enumerate(SCRIPT, 1):
            _step(optimizer, variables, value)
            got = (
                int(optimizer.consecutive_skips.numpy()),
                int(optimizer.window_steps.numpy()),
                int(optimizer.window_skips.numpy()),
                float(optimizer.dynamic_scale.numpy()),
            )
            assert got == (consecutive, steps, skipped, scale), f"step {number}"
            if value == INF:
                # The second variable's gradient, 1 of 2, the loss finite.
                assert optimizer.first_non_finite.numpy().tolist() == [1, 1, 1]
    frequent = [w for w in caught if "training steps were skipped" in str(w.message)]
    assert [str(w.message)[:41] for w in frequent] == [
        "2 of the last 3 training steps were skipp"
    ]
    # Only the 3 finite steps moved the weights: SGD (learning rate 0.5) on
    # gradients of ones divided by S = 8, 4 and 2 (exact in float32).
    expected = 1.0 - 0.5 * (1 / 8 + 1 / 4 + 1 / 2)
    np.testing.assert_array_equal(variables[0].numpy(), np.full(3, expected, np.float32))
    np.testing.assert_array_equal(variables[1].numpy(), np.full(2, expected, np.float32))


def test_a_non_finite_loss_is_recorded():
    optimizer, variables = _optimizer(max_consecutive_skips=None)
    _step(optimizer, variables, INF, loss=INF)
    assert optimizer.first_non_finite.numpy().tolist() == [1, 1, 0]


def test_the_global_scale_stops_at_its_floor():
    # Keras halves for good (2**-23 -> 2**-26 here); tf_als stops at the
    # floor, so that a finite step never divides by 0.
    optimizer, variables = _optimizer(initial_scale=2.0**-23, max_consecutive_skips=None)
    for _ in range(3):
        _step(optimizer, variables, INF)
    assert rule.MIN_SCALE == 2.0**-24
    assert float(optimizer.dynamic_scale.numpy()) == 2.0**-24
    assert int(optimizer.consecutive_skips.numpy()) == 3


def test_max_consecutive_skips_in_a_row_stop_the_run():
    optimizer, variables = _optimizer(initial_scale=16.0, max_consecutive_skips=2)
    _step(optimizer, variables, INF)
    with pytest.raises(tf_als.NonFiniteStormError, match="2 consecutive"):
        _step(optimizer, variables, INF)
