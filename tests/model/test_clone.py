"""`keras.models.clone_model` of an instrumented model: keras.io's DDIM makes
its EMA network so, and distillation makes students so. Keras's clone has
new layers and variables; the clone of an instrumented model is an
instrumented model of the same class, with fresh scaling state, whose
weights line up with the original's."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tf_als._src.training import state as state_module


def _functional():
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(x), name="net")


class _Unregistered(keras.Model):
    """A subclassed model Keras finds by its class's own name only (not
    registered), with a config of its own and no `from_config`."""

    def __init__(self, units=16, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.head = keras.layers.Dense(3)

    def call(self, x):
        return self.head(self.hidden(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def _batch(seed=0):
    return np.random.default_rng(seed).normal(size=(16, 8)).astype("float32")


def _train(model, steps=3):
    model.compile(
        optimizer=tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.1)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x = np.concatenate([_batch(i) for i in range(steps)])
    y = np.arange(len(x)) % 3
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)


def _assert_a_clone(original, clone):
    """`clone` is instrumented as `original` is, of its class, with variables
    of its own that line up with the original's; set to the original's
    values, it computes the same outputs (the same graph and weights:
    exactly, in float16), and its scaling state starts fresh."""
    assert isinstance(clone, tf_als.InstrumentedModel)
    assert isinstance(clone, type(original.uninstrumented()))
    assert clone.float32_outputs == original.float32_outputs
    # The same points, of new layers (a subclassed model's get new names).
    kinds = lambda model: [type(p.layer).__name__ for p in model.point_records]  # noqa: E731
    assert kinds(clone) == kinds(original)
    layers = {id(l) for l in original.uninstrumented()._flatten_layers()}
    assert not any(id(p.layer) in layers for p in clone.point_records)
    assert len(clone.weights) == len(original.weights)
    for w, c in zip(original.weights, clone.weights):
        assert w.shape == c.shape and w is not c
    # The EMA update as keras.io's DDIM writes it.
    for w, c in zip(original.weights, clone.weights):
        c.assign(w)
    x = _batch(7)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(clone(x)), keras.ops.convert_to_numpy(original(x))
    )
    assert clone.scaling_state is not original.scaling_state
    assert clone.scaling_state.records is not original.scaling_state.records
    # As a new state's (a trained original's records are not copied).
    fresh = state_module.ScalingState([p.name for p in clone.point_records])
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(clone.scaling_state.records),
        keras.ops.convert_to_numpy(fresh.records),
    )


def test_clone_of_an_instrumented_functional_model_is_instrumented(mixed):
    original = tf_als.instrument(_functional(), float32_outputs=True)
    _train(original)
    # The original recorded its steps: the clone's fresh state is no copy.
    assert keras.ops.convert_to_numpy(original.scaling_state.records).any()
    clone = keras.models.clone_model(original)
    _assert_a_clone(original, clone)
    _train(clone)  # It trains as its own model.
    assert all(np.isfinite(keras.ops.convert_to_numpy(w)).all() for w in clone.weights)


def test_clone_honours_the_users_clone_and_call_functions(mixed):
    """A `clone_function` (here: a ReLU layer made Leaky) and a
    `call_function` (here: a Dropout after the hidden layer) change the
    clone as Keras's clone of the plain model changes."""
    original = tf_als.instrument(_functional())

    def clone_function(layer):
        config = layer.get_config()
        if config.get("activation") == "relu":
            config["activation"] = "leaky_relu"
        return layer.__class__.from_config(config)

    def call_function(layer, *args, **kwargs):
        out = layer(*args, **kwargs)
        if layer.name == "hidden":
            out = keras.layers.Dropout(0.5, name="added")(out)
        return out

    kwargs = dict(clone_function=clone_function, call_function=call_function)
    clone = keras.models.clone_model(original, **kwargs)
    plain = keras.models.clone_model(original.uninstrumented(), **kwargs)
    assert isinstance(clone, tf_als.InstrumentedModel)
    assert [l.name for l in clone.layers] == [l.name for l in plain.layers]
    assert "added" in [l.name for l in clone.layers]
    assert clone.get_layer("hidden").get_config()["activation"] == "leaky_relu"
    for w, c in zip(plain.weights, clone.weights):
        c.assign(w)
    x = _batch(3)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(clone(x)), keras.ops.convert_to_numpy(plain(x))
    )


def test_clone_of_an_instrumented_subclassed_model_found_by_name(mixed):
    """Keras clones a subclassed model by serialising it and rebuilding it
    from the class of its name (here an unregistered class, which Keras
    finds among its `custom_objects`): instrumented too."""
    model = _Unregistered(units=12)
    model(_batch())
    original = tf_als.instrument(model)
    clone = keras.models.clone_model(original)
    assert clone.units == 12
    _assert_a_clone(original, clone)


def test_a_sequential_clone_is_plain_and_instrumenting_it_is_the_advice(mixed):
    """Keras rebuilds a Sequential model as a plain `Sequential` (no hook
    for tf_als): the clone is the plain model, with new variables, and
    `tf_als.instrument` of it, as docs/training-loops.md advises, gives an
    instrumented copy that computes what the original computes."""
    original = tf_als.instrument(keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3),
    ]))
    clone = keras.models.clone_model(original)
    assert not isinstance(clone, tf_als.InstrumentedModel)
    _assert_a_clone(original, tf_als.instrument(clone))
