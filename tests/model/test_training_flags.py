"""Every call's `training` flag resolves exactly as Keras resolves it.

Keras 3.15's `Functional.call` hands its own `training` argument to every
node it runs, over the flag the node was built with; a node's recorded
flag (`base(x, training=False)`, `Dropout(0.5)(x, training=True)`) counts
only when the outer call gives none (keras-team/keras#20285: under `fit`,
a base model called with `training=False` runs in training mode). Keras
3.16 gives the recorded flag precedence again (keras-team/keras#23364);
tf_als reads which rule holds from Keras (`_keras.recorded_training_wins`)
and runs the same calls, so its forward pass must resolve every flag the same
way, at every depth: the outputs are compared bitwise (tolerance 0) with
the plain model's under every combination of outer and inner flags, with
and without XLA, and the keras.io transfer-learning recipe (frozen, then
unfrozen and recompiled) ends with the same weights and statistics as
under Keras's `LossScaleOptimizer`.
"""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tf_als._src.model import _keras

layers = keras.layers
FLAGS = (True, False, None)


class _Reads(layers.Layer):
    """Triples its input in training mode: the flag it received shows in
    the output, whatever the layer's weights."""

    def call(self, x, training=None):
        return x * 3.0 if training else x


def _base(name):
    """Dense, BatchNormalization (batch statistics in training mode, the
    moving ones otherwise) and `_Reads`: each flag changes the output."""
    inputs = keras.Input((6,))
    x = layers.Dense(6, name=f"{name}_dense")(inputs)
    x = layers.BatchNormalization(name=f"{name}_bn")(x)
    return keras.Model(inputs, _Reads(name=f"{name}_reads")(x), name=name)


def _model(depth, inner):
    """A head over a base called with `training=inner`: the base is a
    layer (`depth` 0), a nested model (1) or a model nested in a nested
    model, each level called with the flag (2)."""
    inputs = keras.Input((6,))
    if depth == 0:
        x = layers.Dense(6, name="dense")(inputs)
        x = _Reads(name="reads")(x, training=inner)
    else:
        base = _base("base")
        if depth == 2:
            middle_in = keras.Input((6,))
            base = keras.Model(
                middle_in, base(middle_in, training=inner), name="middle"
            )
        x = base(inputs, training=inner)
    return keras.Model(inputs, layers.Dense(3, name="head", dtype="float32")(x))


def _batch():
    return np.random.default_rng(0).normal(2.0, 3.0, (8, 6)).astype("float32")


@pytest.mark.parametrize("depth", [0, 1, 2], ids=["layer", "nested", "twice_nested"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager_graph", "xla"])
def test_every_flag_resolves_as_in_keras(mixed, depth, jit):
    x = tf.constant(_batch())
    for inner, outer in itertools.product(FLAGS, FLAGS):
        model = _model(depth, inner)
        instrumented = tf_als.instrument(model)
        run = lambda m: tf.function(  # noqa: E731
            lambda: m(x, training=outer), jit_compile=jit
        )()
        expected, actual = run(model), run(instrumented)
        np.testing.assert_array_equal(
            np.asarray(actual), np.asarray(expected),
            err_msg=f"inner training={inner}, outer training={outer}",
        )


def test_the_flags_change_the_outputs(mixed):
    """The comparison above can fail: the flag reaching the base changes
    the output (batch statistics and `_Reads`' factor). Two models of the
    same weights, the base called with `training=True` and `False`, under
    an outer call that gives none: the base's own flag counts under every
    Keras (keras-team/keras#20285, #23364)."""
    x = _batch()
    outputs = []
    for inner in (True, False):
        keras.utils.set_random_seed(0)
        outputs.append(np.asarray(_model(1, inner)(x)))
    assert np.max(np.abs(outputs[0] - outputs[1])) > 0.1


def _recipe(optimizer_class, seed=0):
    """keras.io's transfer-learning recipe at CPU scale: a frozen
    convolutional base called with `training=False`, a new head trained
    for an epoch; then the base unfrozen, the model recompiled and
    trained again. Returns the base's first kernel and BatchNormalization
    statistics after each phase."""
    keras.utils.set_random_seed(seed)
    image = keras.Input((12, 12, 3))
    x = layers.Conv2D(8, 3, name="conv")(image)
    x = layers.BatchNormalization(name="bn")(x)
    base = keras.Model(image, layers.Dropout(0.3)(x), name="base")
    base.trainable = False
    inputs = keras.Input((12, 12, 3))
    x = layers.GlobalAveragePooling2D()(base(inputs, training=False))
    model = keras.Model(inputs, layers.Dense(2, activation="softmax", dtype="float32")(x))
    if optimizer_class is tf_als.AdaptiveLossScaleOptimizer:
        model = tf_als.instrument(model)
    rng = np.random.default_rng(1)
    x = rng.random((32, 12, 12, 3)).astype("float32") * 4
    y = rng.integers(0, 2, 32)
    read = lambda: [  # noqa: E731
        np.array(v) for v in (
            base.get_layer("conv").kernel, base.get_layer("bn").moving_mean,
            base.get_layer("bn").moving_variance,
        )
    ]
    phases = []
    for trainable in (False, True):
        base.trainable = trainable
        model.compile(
            optimizer_class(keras.optimizers.Adam(1e-2)),
            "sparse_categorical_crossentropy",
        )
        model.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)
        phases.append(read())
    return phases


def test_transfer_learning_recipe_trains_as_under_keras(mixed):
    """Frozen, the base's kernel and statistics stay; unfrozen, its
    kernel moves, and Keras 3.15 runs the base in training mode (the outer
    flag wins), so its moving statistics follow the new data, where Keras
    3.16 keeps the recorded `training=False` and they stay: tf_als the
    same, on either.
    Tolerance: the moving statistics are forward values, equal bit for
    bit; the kernel trains on gradients that tf_als scales by powers of
    two, exact unless a value underflows in Keras's run, so they agree to
    float32 rounding of Adam's update (1e-6)."""
    keras_phases = _recipe(keras.optimizers.LossScaleOptimizer)
    ours = _recipe(tf_als.AdaptiveLossScaleOptimizer)
    (k_frozen, *stats_frozen), (k_tuned, *stats_tuned) = ours
    start = keras_phases[0][0]
    np.testing.assert_array_equal(k_frozen, start)
    assert np.max(np.abs(k_tuned - start)) > 1e-3  # fine-tuning moved it
    moved = np.max(np.abs(stats_tuned[0] - stats_frozen[0]))
    if _keras.recorded_training_wins():  # Keras 3.16
        assert moved == 0.0
    else:
        assert moved > 1e-3
    for theirs, mine in zip(keras_phases, ours):
        np.testing.assert_allclose(mine[0], theirs[0], rtol=0, atol=1e-6)
        for a, b in zip(mine[1:], theirs[1:]):
            np.testing.assert_array_equal(a, b)


class _Mode(layers.Layer):
    """A composite (a Dense inside) whose `call` declares a keyword
    argument of its own (`factor`) and a call-context argument
    (`foo_mode`, registered as Keras 3.15's docstring of
    `_register_call_context_args` shows): each changes the output."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._register_call_context_args("foo_mode")
        self.dense = layers.Dense(4, name="inner")

    def call(self, x, foo_mode=False, factor=2.0):
        return self.dense(x) * (factor + (10.0 if foo_mode else 0.0))


@pytest.mark.parametrize("recorded", [None, False], ids=["context", "recorded_false"])
def test_call_arguments_reach_every_call_as_in_keras(mixed, recorded):
    """Besides `training`: a keyword argument recorded on the node
    (`factor=3.0`), and a call-context argument given to the model's call
    (`foo_mode`), which Keras hands to every layer that registered it unless
    the node recorded its own. Outputs equal the plain model's bitwise
    under every value, and the values change the output (so the comparison
    can fail)."""
    inputs = keras.Input((4,))
    x = layers.Dense(4, name="first")(inputs)
    extra = {} if recorded is None else {"foo_mode": recorded}
    x = _Mode(name="mode")(x, factor=3.0, **extra)
    model = keras.Model(inputs, layers.Dense(2, name="head", dtype="float32")(x))
    model._register_call_context_args("foo_mode")
    instrumented = tf_als.instrument(model)
    batch = _batch()[:, :4]
    outputs = {}
    for given in ({}, {"foo_mode": True}, {"foo_mode": False}):
        expected = np.asarray(model(batch, training=True, **given))
        with tf.GradientTape():  # recorded: the scaling points run
            actual = np.asarray(instrumented(batch, training=True, **given))
        np.testing.assert_array_equal(actual, expected, err_msg=str(given))
        outputs[tuple(given.items())] = expected
    on, off = outputs[(("foo_mode", True),)], outputs[(("foo_mode", False),)]
    # Keras hands `foo_mode` to the node only where none was recorded.
    assert (np.max(np.abs(on - off)) > 0.1) == (recorded is None)
