"""`tf_als.instrument`, `tf_als.scales` and `InstrumentedModel`: what the
plan finds, bitwise-equal forward passes, shared weights, serialisation,
and errors for everything that cannot be instrumented."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tests import architectures

layers = keras.layers


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else [])
        for c in architectures.CASES
    ],
)
@pytest.mark.parametrize("training", [True, False])
def test_forward_outputs_are_bitwise_equal(case, training):
    _, model = case.build_pair()
    instrumented = tf_als.instrument(model)
    x, _ = case.data()
    expected = keras.tree.flatten(model(x, training=training))
    with tf.GradientTape():  # recorded: the scaling points run
        actual = keras.tree.flatten(instrumented(x, training=training))
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def test_forward_is_bitwise_equal_compiled(mixed):
    _, model = architectures.CASES[2].build_pair()  # resnet
    instrumented = tf_als.instrument(model)
    x, _ = architectures.CASES[2].data()
    for jit in (False, True):
        expected = tf.function(lambda: model(x, training=True), jit_compile=jit)()
        actual = tf.function(
            lambda: instrumented(x, training=True), jit_compile=jit
        )()
        np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))


def test_masks_propagate_through_scaling_points(mixed):
    """Embedding(mask_zero=True) -> LSTM: the mask must reach the LSTM
    through the scaling point's custom gradient."""
    tokens = keras.Input((6,), dtype="int32")
    x = layers.Embedding(20, 8, mask_zero=True)(tokens)
    x = layers.LSTM(8)(x)
    model = keras.Model(tokens, layers.Dense(2, dtype="float32")(x))
    ids = np.array([[3, 4, 0, 0, 0, 0], [5, 6, 7, 8, 9, 1]], "int32")
    instrumented = tf_als.instrument(model)
    with tf.GradientTape():  # recorded: the scaling points run
        actual = instrumented(ids, training=True)
    np.testing.assert_array_equal(
        np.asarray(actual), np.asarray(model(ids, training=True))
    )
    # The mask changes the result, so it was not silently dropped.
    unmasked = np.asarray(model(np.where(ids == 0, 1, ids), training=True))
    assert not np.array_equal(unmasked, np.asarray(actual))


def test_an_eager_call_no_tape_records_runs_the_plain_model(mixed, monkeypatch):
    """A decode loop's eager call has no gradient to scale: it runs the
    model given to `instrument`, without building a backward pass (which
    made such a call 1.5x the plain model's, `benchmarks/eager_call.py`).
    Under a tape, or traced, the scaling points run."""
    from tf_als._src.training import backward

    _, model = architectures.CASES[0].build_pair()
    instrumented = tf_als.instrument(model)
    x, _ = architectures.CASES[0].data()

    def refuse(*args, **kwargs):
        raise AssertionError("a backward pass was built")

    monkeypatch.setattr(backward, "Backward", refuse)
    for training in (True, False):
        np.testing.assert_array_equal(
            np.asarray(instrumented(x, training=training)),
            np.asarray(model(x, training=training)),
        )
    with pytest.raises(AssertionError, match="backward pass was built"):
        with tf.GradientTape():
            instrumented(x, training=True)
    with pytest.raises(AssertionError, match="backward pass was built"):
        tf.function(lambda: instrumented(x, training=False))()


def test_shares_layers_and_weights(mixed):
    _, model = architectures.CASES[5].build_pair()  # shared_layer
    instrumented = tf_als.instrument(model)
    assert instrumented.uninstrumented() is model
    assert [id(v) for v in instrumented.trainable_variables] == [
        id(v) for v in model.trainable_variables
    ]
    kernel = model.trainable_variables[0]
    kernel.assign(kernel * 2.0)
    x, _ = architectures.CASES[5].data()
    np.testing.assert_array_equal(
        np.asarray(instrumented(x)), np.asarray(model(x))
    )
    # tf_als's own state: float32 scales and records, int64 steps, int32
    # counters (steps of all-zero gradients).
    for variable in instrumented.non_trainable_variables:
        assert variable.dtype in ("float32", "int64", "int32")


def test_point_names_follow_layers_and_calls(mixed):
    _, shared = architectures.CASES[5].build_pair()
    names = list(tf_als.scales(tf_als.instrument(shared)))
    dense = [layer.name for layer in shared.layers if layer.name != "shared"]
    assert names == [dense[1], "shared/call_0", "shared/call_1", dense[2]]

    _, nested = architectures.CASES[6].build_pair()
    names = list(tf_als.scales(tf_als.instrument(nested)))
    encoder = nested.get_layer("encoder")
    head = nested.get_layer("head")
    expected = [f"encoder/{layer.name}" for layer in encoder.layers]
    expected += [
        f"head/{layer.name}" for layer in head.layers if layer.weights
    ]
    expected += [nested.layers[-1].name]
    assert names == expected


def test_a_layer_called_again_outside_its_nested_model_keeps_its_path(mixed):
    """A tied layer (an embedding reused as an output head) called inside a
    nested model and again by the outer one: both calls are named from the
    path of its first call."""
    shared = keras.layers.Dense(8, name="tied")
    inputs = keras.Input((8,))
    encoder = keras.Model(inputs, shared(inputs), name="encoder")
    outer_inputs = keras.Input((8,))
    x = encoder(outer_inputs)
    outputs = keras.layers.Dense(2, name="head")(shared(x))
    model = keras.Model(outer_inputs, outputs, name="outer")
    names = list(tf_als.scales(tf_als.instrument(model)))
    assert names == ["encoder/tied/call_0", "encoder/tied/call_1", "head"]


def test_weightless_layers_are_not_points(mixed):
    inputs = keras.Input((8,))
    x = layers.Dense(8)(inputs)
    x = layers.Activation("relu")(x)
    x = layers.Dropout(0.5)(x)
    x = layers.Reshape((2, 4))(x)
    outputs = layers.Flatten()(x)
    model = keras.Model(inputs, outputs)
    assert list(tf_als.scales(tf_als.instrument(model))) == [model.layers[1].name]


def test_subclassed_model_inside_is_one_point(mixed):
    class Block(keras.Model):
        def __init__(self):
            super().__init__()
            self.first = layers.Dense(8, activation="relu")
            self.second = layers.Dense(8)

        def call(self, x):
            return self.second(self.first(x))

    inputs = keras.Input((8,))
    block = Block()
    outputs = layers.Dense(2, dtype="float32")(block(inputs))
    model = keras.Model(inputs, outputs)
    instrumented = tf_als.instrument(model)
    assert list(tf_als.scales(instrumented))[0] == block.name
    x = np.ones((4, 8), "float32")
    np.testing.assert_array_equal(np.asarray(instrumented(x)), np.asarray(model(x)))


def test_config_is_the_users_and_a_bare_from_config_says_what_to_do(mixed):
    """`get_config` is the user's model's own (the instrumented model is an
    instance of its class); rebuilding from it gives the user's model.
    `InstrumentedModel.from_config` needs the whole saved config and says
    how to load one instead."""
    _, model = architectures.CASES[5].build_pair()
    instrumented = tf_als.instrument(model)
    config = instrumented.get_config()
    assert config == model.get_config()
    serialized = keras.saving.serialize_keras_object(instrumented)
    assert serialized["registered_name"] == keras.saving.get_registered_name(type(model))
    clone = keras.saving.deserialize_keras_object(serialized)
    assert type(clone) is type(model) and clone.get_config() == config
    with pytest.raises(ValueError, match="keras.models.load_model"):
        tf_als.InstrumentedModel.from_config(config)


def test_save_and_load_keeps_scales_and_sharing(mixed, tmp_path):
    _, model = architectures.CASES[5].build_pair()
    instrumented = tf_als.instrument(model)
    for i, point in enumerate(instrumented.scaling_points):
        point.scale.assign(2.0**i)
    path = str(tmp_path / "model.keras")
    instrumented.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, tf_als.InstrumentedModel)
    assert tf_als.scales(loaded) == tf_als.scales(instrumented)
    shared = [
        layer for layer in loaded.uninstrumented().layers if layer.name == "shared"
    ]
    assert len(shared) == 1 and len(shared[0]._inbound_nodes) == 2
    x, _ = architectures.CASES[5].data()
    np.testing.assert_array_equal(
        np.asarray(loaded(x)), np.asarray(instrumented(x))
    )


# -- errors ---------------------------------------------------------------


def test_subclassed_model_at_the_top_is_opened(mixed):
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = layers.Dense(4, activation="relu")
            self.out = layers.Dense(2)

        def call(self, x):
            return self.out(self.hidden(x))

    net = Net()
    x = np.ones((1, 3), "float32")
    expected = np.asarray(net(x))
    instrumented = tf_als.instrument(net)
    assert [(p.name, p.kind) for p in tf_als.points(instrumented)] == [
        (net.name, "composite"),
        (f"{net.name}/{net.hidden.name}", "layer"),
        (f"{net.name}/{net.out.name}", "layer"),
    ]
    np.testing.assert_array_equal(np.asarray(instrumented(x)), expected)


def test_unbuilt_subclassed_model_is_refused(mixed):
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    with pytest.raises(ValueError, match="has no weights yet.*model\\(x\\)"):
        tf_als.instrument(Net())


def test_instrumenting_twice_is_refused(mixed):
    _, model = architectures.CASES[0].build_pair()
    instrumented = tf_als.instrument(model)
    with pytest.raises(ValueError, match="already instrumented"):
        tf_als.instrument(instrumented)


def test_unbuilt_sequential_is_refused(mixed):
    model = keras.Sequential([layers.Dense(2)])
    with pytest.raises(ValueError, match="not built yet.*build"):
        tf_als.instrument(model)


def test_not_a_model_is_refused():
    with pytest.raises(TypeError, match="must be a keras.Model.*Dense"):
        tf_als.instrument(layers.Dense(2))


def test_model_without_weights_is_refused(mixed):
    inputs = keras.Input((4,))
    model = keras.Model(inputs, layers.Activation("relu")(inputs))
    with pytest.raises(ValueError, match="no layer with weights"):
        tf_als.instrument(model)


def test_activity_regularizer_on_a_weight_layer_is_refused(mixed):
    inputs = keras.Input((4,))
    outputs = layers.Dense(2, activity_regularizer="l2")(inputs)
    with pytest.raises(ValueError, match="ActivityRegularization"):
        tf_als.instrument(keras.Model(inputs, outputs))


def test_compile_wraps_any_optimizer_in_an_adaptive_one(mixed):
    """As Keras wraps an optimizer in a `LossScaleOptimizer` under
    `mixed_float16`, the instrumented model's compile (its own, or a
    model class's that hands on to it) makes every optimizer an
    `AdaptiveLossScaleOptimizer`: a name or a plain optimizer wrapped, a
    Keras `LossScaleOptimizer` converted with its knobs."""
    _, model = architectures.CASES[0].build_pair()
    instrumented = tf_als.instrument(model)
    instrumented.compile(optimizer="adam", loss="mse")
    assert isinstance(instrumented.optimizer, tf_als.AdaptiveLossScaleOptimizer)
    assert isinstance(instrumented.optimizer.inner_optimizer, keras.optimizers.Adam)
    keras_scaler = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=2.0**9, dynamic_growth_steps=7
    )
    instrumented.compile(optimizer=keras_scaler, loss="mse")
    ours = instrumented.optimizer
    assert isinstance(ours, tf_als.AdaptiveLossScaleOptimizer)
    assert ours.inner_optimizer is keras_scaler.inner_optimizer
    assert (ours.initial_scale, ours.dynamic_growth_steps) == (2.0**9, 7)
    mine = tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam())
    instrumented.compile(optimizer=mine, loss="mse")
    assert instrumented.optimizer is mine


def test_scales_of_a_plain_model_is_an_error(mixed):
    _, model = architectures.CASES[0].build_pair()
    with pytest.raises(TypeError, match="tf_als.instrument"):
        tf_als.scales(model)


def test_instrumented_model_inside_another_is_refused(mixed):
    _, model = architectures.CASES[0].build_pair()
    inner = tf_als.instrument(model)
    inputs = keras.Input((32,))
    outer = keras.Model(inputs, inner(inputs))
    with pytest.raises(ValueError, match="scaled twice.*instrument the outer"):
        tf_als.instrument(outer)


def _compiled_two_headed(optimizer):
    _, model = architectures.CASES[7].build_pair()  # two_in_two_out
    model.compile(
        optimizer=optimizer,
        loss={"label": "sparse_categorical_crossentropy", "value": "mse"},
        loss_weights={"label": 1.0, "value": 0.25},
        metrics={"label": ["accuracy"]},
        jit_compile=False,
    )
    return model


def test_instrumenting_a_compiled_model_keeps_its_compile(mixed):
    model = _compiled_two_headed(keras.optimizers.Adam(1e-3))
    # Keras wrapped the Adam in its LossScaleOptimizer (mixed_float16).
    wrapped = model.optimizer
    instrumented = tf_als.instrument(model)
    assert instrumented.compiled
    optimizer = instrumented.optimizer
    assert isinstance(optimizer, tf_als.AdaptiveLossScaleOptimizer)
    assert optimizer.inner_optimizer is wrapped.inner_optimizer
    assert optimizer.initial_scale == wrapped.initial_scale
    ours, theirs = instrumented.get_compile_config(), model.get_compile_config()
    ours.pop("optimizer"), theirs.pop("optimizer")
    assert ours == theirs
    x, y = architectures.CASES[7].data()
    y = {"label": y[0], "value": y[1]}
    history = instrumented.fit(x, y, epochs=1, verbose=0)
    assert {"loss", "label_accuracy"} <= set(history.history)


def test_instrumenting_a_compiled_model_carries_the_optimizer_over(mixed):
    optimizer = tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD())
    instrumented = tf_als.instrument(_compiled_two_headed(optimizer))
    assert instrumented.optimizer is optimizer
    keras_scaling = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=2.0**10, dynamic_growth_steps=50
    )
    instrumented = tf_als.instrument(_compiled_two_headed(keras_scaling))
    assert instrumented.optimizer.inner_optimizer is keras_scaling.inner_optimizer
    assert instrumented.optimizer.initial_scale == 2.0**10
    assert instrumented.optimizer.dynamic_growth_steps == 50


def test_an_uncompiled_model_gives_an_uncompiled_one(mixed):
    _, model = architectures.CASES[0].build_pair()
    assert not tf_als.instrument(model).compiled


def _count_train_step_traces(model):
    """Wraps `model.train_step` to count how often `fit` traces it."""
    traces = []
    train_step = model.train_step

    def counted(data):
        traces.append(1)
        return train_step(data)

    model.train_step = counted
    return traces


@pytest.mark.parametrize("data", ["arrays", "dataset"])
def test_fit_traces_the_train_step_once(mixed, data):
    """Without a distribution strategy Keras creates the optimizer's and
    metrics' variables during the first trace, so TensorFlow traces the
    step again; the instrumented model's `fit` creates them first."""
    _, model = architectures.CASES[2].build_pair()  # resnet
    x, y = architectures.CASES[2].data()
    instrumented = tf_als.instrument(model)
    instrumented.compile(
        optimizer=tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.01)),
        loss=architectures.CASES[2].loss,
        metrics=["accuracy"],
    )
    traces = _count_train_step_traces(instrumented)
    if data == "arrays":
        history = instrumented.fit(x, y, batch_size=len(x), epochs=2, verbose=0)
    else:
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x))
        history = instrumented.fit(dataset, epochs=2, verbose=0)
    assert len(traces) == 1
    assert instrumented.optimizer.iterations.numpy() == 2
    assert np.isfinite(history.history["accuracy"]).all()


def test_layers_and_summary_read_as_the_users_model(mixed, capsys):
    """tf_als's state is not among the instrumented model's layers:
    `layers`, `get_layer`, `weights` and `summary` read as the user's."""
    _, model = architectures.CASES[5].build_pair()  # shared_layer
    instrumented = tf_als.instrument(model)
    assert [l.name for l in instrumented.layers] == [l.name for l in model.layers]
    assert all(a is b for a, b in zip(instrumented.layers, model.layers))
    assert instrumented.get_layer("shared") is model.get_layer("shared")
    assert [id(w) for w in instrumented.weights] == [id(w) for w in model.weights]
    printed, expected = [], []
    instrumented.summary(print_fn=printed.append)
    model.summary(print_fn=expected.append)
    assert printed == expected


_LOAD_WITHOUT_TF_ALS = """
import sys
import keras
import numpy as np
keras.mixed_precision.set_global_policy("mixed_float16")
model = keras.models.load_model(sys.argv[1])  # compile=True, the default
assert "tf_als" not in sys.modules, "the file imported tf_als"
x = np.load(sys.argv[2])
np.save(sys.argv[3], model.predict(x, verbose=0))
# Compiled with Keras's own LossScaleOptimizer (over the saved Adam): it trains.
assert type(model.optimizer).__name__ == "LossScaleOptimizer", model.optimizer
assert type(model.optimizer.inner_optimizer).__name__ == "Adam"
history = model.fit(x, np.load(sys.argv[3]), verbose=0)
assert np.isfinite(history.history["loss"][-1])
print(type(model).__name__, [layer.name for layer in model.layers])
"""


def test_a_saved_model_loads_without_tf_als_as_the_users_model(mixed, tmp_path):
    """A `.keras` file is handed on: where tf_als is not imported it loads,
    with `load_model`'s default `compile=True`, as the user's own model
    (its class, layers and trained weights: the same predictions, bit for
    bit), compiled with Keras's `LossScaleOptimizer` over the same inner
    optimizer; where tf_als is, as the instrumented model with its scales
    and tf_als's optimizer."""
    import subprocess
    import sys

    _, model = architectures.CASES[5].build_pair()  # shared_layer
    instrumented = tf_als.instrument(model)
    instrumented.compile(tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-2)), "mse")
    x, _ = architectures.CASES[5].data()
    y = np.asarray(model(x), "float32") * 0.5
    instrumented.fit(x, y, epochs=2, verbose=0)
    path, inputs, outputs = (str(tmp_path / n) for n in ("m.keras", "x.npy", "y.npy"))
    instrumented.save(path)
    np.save(inputs, x)
    ran = subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_TF_ALS, path, inputs, outputs],
        capture_output=True, text=True, timeout=300,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split()[0] == type(model).__name__
    np.testing.assert_array_equal(np.load(outputs), instrumented.predict(x, verbose=0))
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, tf_als.InstrumentedModel) and isinstance(loaded, type(model))
    assert tf_als.scales(loaded) == tf_als.scales(instrumented)
    assert isinstance(loaded.optimizer, tf_als.AdaptiveLossScaleOptimizer)
    assert loaded.optimizer.get_config() == instrumented.optimizer.get_config()
    for saved, restored in zip(instrumented.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(restored), np.asarray(saved), saved.path)
