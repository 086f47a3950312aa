"""The scaling points' state: stacked rows, and what a compiled step touches.

A compiled step pays for every variable it may touch on every step (XLA
passes each in and out of the computation, through branches that do not
run too), so tf_als keeps its per-point state in a few `[points, ...]`
variables. These tests pin that: the variables the traced train step
captures grow with the number of points exactly as Keras's own do (the
layers' weights and the inner optimizer's slots), and a point's `Row`
reads and writes its own row only.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tf_als._src.training import state as state_module
from tests.modes import JIT_COMPILE


def _mlp(layers):
    inputs = keras.Input((4,))
    x = inputs
    for _ in range(layers):
        x = keras.layers.Dense(4, activation="tanh")(x)
    return keras.Model(inputs, keras.layers.Dense(1)(x))


def _captured_variables(layers, adaptive, jit_compile):
    """How many variable handles the train step of a `layers`-deep MLP
    (plus its head) captures when traced."""
    model = _mlp(layers)
    if adaptive:
        model = tf_als.instrument(model)
        optimizer = tf_als.AdaptiveLossScaleOptimizer(
            keras.optimizers.Adam(), telemetry_interval=1
        )
    else:
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
    # The fit only builds the optimizer's and metrics' variables, so it runs
    # without XLA: compiling its program with XLA cost 10-20 s per model,
    # and what is counted is the trace below, in the mode under test.
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)  # builds all
    # The step as Keras compiles it for `fit` (its `one_step_on_data`).
    step = tf.function(model.train_step, jit_compile=jit_compile)
    traced = step.get_concrete_function((x[:4], x[:4, :1]))
    return sum(t.dtype == tf.resource for t in traced.captured_inputs)


@pytest.mark.parametrize("jit_compile", JIT_COMPILE)
def test_the_step_touches_as_many_more_variables_whatever_the_points(
    mixed, jit_compile
):
    """2 and 12 hidden layers (3 and 13 points): tf_als's step captures
    more variables than Keras's by the same count at both depths, so no
    variable is added per point (before stacking, each point added six)."""
    extra = {
        layers: _captured_variables(layers, True, jit_compile)
        - _captured_variables(layers, False, jit_compile)
        for layers in (2, 12)
    }
    assert extra[2] == extra[12], extra
    assert 0 < extra[2] <= 16, extra


def test_a_row_reads_and_writes_its_own_row_only():
    state = state_module.ScalingState(["a", "b", "c"])
    point = state.point(1)
    point.scale.assign(8.0)
    point.record.assign(np.arange(len(state_module.RECORD_FIELDS), dtype=np.float32))
    point.last_update.assign(7)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(state.scales), [1, 8, 1])
    assert float(point.scale) == 8.0
    assert int(point.last_update) == 7
    assert state.point(0).read()["last_update"] == -1
    assert state.point(2).read()["cumulative_scale"] == 1.0
    values = point.read()
    assert values["scale"] == 8.0 and values["percentile"] == 1.0
    np.testing.assert_array_equal(
        tf.convert_to_tensor(point.record).numpy(),
        np.arange(len(state_module.RECORD_FIELDS)),
    )
    assert [v.tolist() for v in point.scale.replica_values()] == [8.0]


def test_a_row_converts_itself_without_a_global_conversion_function():
    """Rows convert through their own `__tf_tensor__` (TensorFlow's tensor
    protocol), so importing tf_als registers nothing in TensorFlow's global
    conversion registry (read through its private module, TensorFlow 2.21)."""
    from tensorflow.python.framework import tensor_conversion_registry

    registered = tensor_conversion_registry.get(state_module.Row)
    assert [base for base, _ in registered] == [object]
    state = state_module.ScalingState(["a", "b"])
    state.point(1).scale.assign(4.0)
    row = state.point(1).scale
    assert tf.convert_to_tensor(row).numpy() == 4.0
    assert tf.cast(row, tf.float64).dtype == tf.float64
    assert (tf.constant(2.0) * row).numpy() == 8.0  # an op given a row
    state.point(0).scale.assign(row)  # a row written from another
    assert keras.ops.convert_to_numpy(state.scales).tolist() == [4.0, 4.0]

    @tf.function
    def doubled():
        return 2.0 * tf.convert_to_tensor(state.point(1).scale)

    assert doubled().numpy() == 8.0


def test_a_row_is_written_inside_a_compiled_function():
    state = state_module.ScalingState(["a", "b"])

    @tf.function(jit_compile=True)
    def write(value):
        state.point(0).scale.assign(value)
        state.point(1).last_update.assign(tf.cast(value, tf.int64))

    write(tf.constant(2.0))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(state.scales), [2, 1])
    assert keras.ops.convert_to_numpy(state.last_updates).tolist() == [-1, 2]


# Record columns of 0.2 and 0.3 files: the cumulative scale and the five
# gradient statistics, no forward headroom.
OLD_RECORD_COLUMNS = 6


def test_a_file_of_main_after_0_2_loads_without_its_measurement_rows():
    """Main between 0.2 and 0.3 saved seven variables (with `measured` and
    `pending`, since removed, and no `backoff`): such a store loads the
    rows it shares, and the back-off starts at 1. (0.2 itself saved six:
    tests/test_legacy_files.py loads a file it wrote.)"""
    state = state_module.ScalingState(["a", "b"])
    old = {
        "0": np.array([4.0, 0.5], np.float32),
        "1": np.full([2, OLD_RECORD_COLUMNS], 3.0, np.float32),
        "2": np.full([2, 40], 0.25, np.float32),
        "3": np.array([7, 7], np.int64),
        "4": np.zeros([2, 258], np.float32),
        "5": np.zeros([2], np.int64),
        "6": np.array(0, np.int64),
    }
    state.load_own_variables(old)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(state.scales), [4, 0.5])
    assert keras.ops.convert_to_numpy(state.last_updates).tolist() == [7, 7]
    assert int(keras.ops.convert_to_numpy(state.due)) == 0
    assert float(keras.ops.convert_to_numpy(state.backoff)) == 1.0
    records = keras.ops.convert_to_numpy(state.records)
    np.testing.assert_array_equal(records[:, :OLD_RECORD_COLUMNS], 3.0)
    np.testing.assert_array_equal(records[:, OLD_RECORD_COLUMNS:], 0.0)
    assert int(keras.ops.convert_to_numpy(state.zero_gradient_steps)) == 0


def test_a_0_3_file_loads_without_forward_columns_and_counter():
    """0.3 saved six variables, records of six columns and no
    `zero_gradient_steps`: the rows load as the records' first columns,
    the forward headroom reads 0 and the counter starts at 0."""
    state = state_module.ScalingState(["a", "b"])
    state.zero_gradient_steps.assign(3)
    records = np.arange(2 * OLD_RECORD_COLUMNS, dtype=np.float32).reshape(2, -1)
    old = {
        "0": np.array([4.0, 0.5], np.float32),
        "1": records,
        "2": np.full([2, 40], 0.25, np.float32),
        "3": np.array([7, 9], np.int64),
        "4": np.array(0, np.int64),
        "5": np.array(2.0, np.float32),
    }
    state.load_own_variables(old)
    loaded = keras.ops.convert_to_numpy(state.records)
    np.testing.assert_array_equal(loaded[:, :OLD_RECORD_COLUMNS], records)
    np.testing.assert_array_equal(loaded[:, OLD_RECORD_COLUMNS:], 0.0)
    assert state.point(1).read()["forward_amax"] == 0.0
    assert state.point(1).read()["near_max_fraction"] == 11.0
    assert keras.ops.convert_to_numpy(state.last_updates).tolist() == [7, 9]
    assert float(keras.ops.convert_to_numpy(state.backoff)) == 2.0
    assert int(keras.ops.convert_to_numpy(state.due)) == 0
    assert int(keras.ops.convert_to_numpy(state.zero_gradient_steps)) == 3


def test_the_current_layout_round_trips():
    """What `save_own_variables` writes (every variable, the forward
    columns and the counter included) loads back unchanged."""
    state = state_module.ScalingState(["a", "b"])
    state.scales.assign([2.0, 8.0])
    state.records.assign(
        np.arange(2 * len(state_module.RECORD_FIELDS), dtype=np.float32).reshape(2, -1)
    )
    state.zero_gradient_steps.assign(4)
    store = {}
    state.save_own_variables(store)
    assert len(store) == len(state_module.VARIABLES)
    again = state_module.ScalingState(["a", "b"])
    again.load_own_variables(store)
    for name in state_module.VARIABLES:
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(getattr(again, name)),
            keras.ops.convert_to_numpy(getattr(state, name)),
            err_msg=name,
        )
    assert again.point(1).read()["forward_near_max_fraction"] == 15.0


def test_old_records_of_another_model_are_refused():
    state = state_module.ScalingState(["a", "b", "c"])
    old = {str(k): v for k, v in enumerate(
        [np.ones([2], np.float32), np.ones([2, OLD_RECORD_COLUMNS], np.float32),
         np.zeros([2, 40], np.float32), np.zeros([2], np.int64),
         np.array(1, np.int64), np.array(1.0, np.float32)]
    )}
    with pytest.raises(ValueError, match="3 scaling points"):
        state.load_own_variables(old)


def test_point_names_must_be_strings():
    with pytest.raises(TypeError, match="point_names"):
        state_module.ScalingState(["a", 3])


def test_config_round_trip():
    state = state_module.ScalingState(["x", "y/call_1"], name="s")
    again = state_module.ScalingState.from_config(state.get_config())
    assert again.point_names == ("x", "y/call_1")
    assert again.name == "s"
