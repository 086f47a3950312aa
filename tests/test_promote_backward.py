"""Self-healing float16 for backward failures (`promote_on_storm`): a layer
whose float16 backward pass turns a finite gradient into a non-finite one,
at any loss scale, is switched to float32, and the run trains on.

The model: first -> temperature -> norm -> head (float32 output).
`temperature` divides its input by a learned temperature t = 2**-8, and a
LayerNormalization takes the scale back out. The forward pass fits float16
(|x / t| stays in the hundreds). The weight gradient of t is
sum(dy * (-x / t) / t), which TensorFlow computes in that order: (-x / t) / t
is x * 2**16, past float16's maximum (65504) for every |x| >= 1, whatever
dy is, so the loss scale cannot help (at a scale where dy underflows to 0,
0 * inf is NaN). float32 holds it.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tests import architectures
from tests.test_promote import custom_loop
from tf_als import backward_search
from tf_als import forward
from tf_als import promote
from tests.modes import JIT_COMPILE

layers = keras.layers
pytestmark = pytest.mark.usefixtures("mixed")

STEPS = 60
BATCH = 16
SKIPS = 4


class Temperature(layers.Layer):
    """y = x / t, with a learned scalar temperature t."""

    def __init__(self, initial=2.0**-8, **kwargs):
        super().__init__(**kwargs)
        self.initial = initial

    def build(self, input_shape):
        self.t = self.add_weight(
            shape=(), initializer=keras.initializers.Constant(self.initial), name="t"
        )

    def call(self, x):
        return x / keras.ops.cast(self.t, x.dtype)

    def get_config(self):
        return {**super().get_config(), "initial": self.initial}


def build(policy=None):
    """The model under `policy` (the global one when None), with fixed
    weights."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    x = layers.Dense(16, name="first", dtype=policy)(inputs)
    x = Temperature(name="temperature", dtype=policy)(x)
    x = layers.LayerNormalization(name="norm", dtype=policy)(x)
    outputs = layers.Dense(4, dtype="float32", name="head")(x)
    return keras.Model(inputs, outputs)


def data(size=BATCH * 4):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(size, 8)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + 2 * (x[:, 1] > 0).astype("int32")


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def optimizer(**kwargs):
    kwargs.setdefault("max_consecutive_skips", SKIPS)
    # SGD: the true gradient of t is about 0 (the normalisation removes
    # t), and Adam would move t by its learning rate on noise alone.
    return tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.1), **kwargs)


def _search_loss(x, y, y_pred, sample_weight):
    return loss_fn()(y, y_pred)


@pytest.mark.parametrize("scale", [2.0**15, 1.0, 2.0**-24])
def test_the_backward_pass_fails_in_float16_only_at_any_scale(scale):
    x, y = data()
    batch = (x[:BATCH], y[:BATCH], None)
    found = backward_search.first_non_finite_gradient(
        build(), _search_loss, batch, scale
    )
    assert found == backward_search.Finding("temperature", backward_search.WEIGHTS)
    assert (
        backward_search.first_non_finite_gradient(
            build("float32"), _search_loss, batch, scale
        )
        is None
    )


def test_the_search_leaves_the_model_as_it_found_it():
    """BatchNormalization's moving statistics and the dropout seed are put
    back after the eager re-run."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = layers.BatchNormalization()(layers.Dense(8)(inputs))
    h = layers.Dropout(0.5)(h)
    model = keras.Model(inputs, layers.Dense(4, dtype="float32")(h))
    x, y = data()
    before = [v.numpy().copy() for v in model.non_trainable_variables]
    assert (
        backward_search.first_non_finite_gradient(
            model, _search_loss, (x, y, None), 1.0
        )
        is None
    )
    after = [v.numpy() for v in model.non_trainable_variables]
    assert len(before) >= 3  # moving mean, moving variance, seed state
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_the_loss_gradient_overflowing_a_float16_output_blames_its_layer():
    """A float16 softmax output under a cross-entropy on probabilities:
    the loss's gradient, -1/p, does not fit float16 where p is small."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = layers.Dense(16, activation="relu", name="hidden")(inputs)
    outputs = layers.Dense(4, activation="softmax", name="probs")(h)
    model = keras.Model(inputs, outputs)
    probs = model.get_layer("probs")
    probs.kernel.assign(probs.kernel * 50.0)
    x, y = data()

    def loss(x, y, y_pred, sample_weight):
        return keras.losses.SparseCategoricalCrossentropy()(y, y_pred)

    found = backward_search.first_non_finite_gradient(model, loss, (x, y, None), 1.0)
    assert found == backward_search.Finding("probs", backward_search.OUTPUT)


def _reference_loss(applied_from, x, y):
    """float32's loss after training on the batches the promoted run
    applied: all but the first `applied_from`."""
    reference = build("float32")
    reference.compile(keras.optimizers.SGD(0.1), loss_fn())
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]
    for i in range(applied_from, STEPS):
        reference.train_on_batch(*batches[i % len(batches)])
    return reference.evaluate(x, y, verbose=0)


@pytest.mark.parametrize("jit_compile", JIT_COMPILE)
def test_fit_promotes_the_layer_and_trains_like_float32(jit_compile):
    """The run skips its first SKIPS steps, promotes `temperature`, and
    trains on at the global scale it started with. Its loss is within 2%
    of float32's after the same applied steps (the issue's bound; measured
    0.18979 against 0.18980: the float16 rounding in `first` is all that
    differs)."""
    x, y = data()
    model = tf_als.instrument(build())
    model.compile(optimizer(), loss_fn(), jit_compile=jit_compile)
    with pytest.warns(UserWarning, match="promoted layer 'temperature' to float32"):
        model.fit(x, y, batch_size=BATCH, epochs=STEPS // 4, verbose=0, shuffle=False)
    assert tf_als.promoted(model) == [
        promote.Promotion(
            layer="temperature",
            reason=f"{promote.BACKWARD} ({backward_search.WEIGHTS})",
            step=0,
        )
    ]
    assert model.model.get_layer("temperature").compute_dtype == "float32"
    assert model.model.get_layer("first").compute_dtype == "float16"
    assert int(model.optimizer.iterations.numpy()) == STEPS - SKIPS
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**15
    expected = _reference_loss(SKIPS, x, y)
    got = model.evaluate(x, y, verbose=0)
    assert abs(got - expected) <= 0.02 * expected, (got, expected)


def test_fit_on_a_dataset_with_sample_weights_promotes_too():
    """The guard re-runs `(x, y, sample_weight)` elements of a
    `tf.data.Dataset` with the compiled loss."""
    x, y = data()
    weights = np.linspace(0.5, 1.5, len(x)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(BATCH)
    model = tf_als.instrument(build())
    model.compile(optimizer(), loss_fn())
    with pytest.warns(UserWarning, match="promoted layer 'temperature'"):
        model.fit(dataset, epochs=3, verbose=0)
    assert [p.layer for p in tf_als.promoted(model)] == ["temperature"]
    assert int(model.optimizer.iterations.numpy()) == 3 * 4 - SKIPS


def test_without_promotion_it_stops_naming_the_layer():
    x, y = data()
    model = tf_als.instrument(build())
    model.compile(optimizer(promote_on_storm=False), loss_fn())
    with pytest.raises(tf_als.NonFiniteStormError, match="'temperature'"):
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)


def _alternate(opt, model, steps):
    """A custom loop whose even steps train on an overflowing batch (and
    are skipped) and whose odd steps apply zero gradients (finite): never
    two skips in a row. Returns the promotions."""
    x, y = data()
    xb, yb = x[:BATCH], y[:BATCH]
    loss = loss_fn()

    def train_step():
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(loss(yb, model(xb, training=True)))
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)

    def zero_step():
        opt.apply(
            [tf.zeros_like(v) for v in model.trainable_variables],
            model.trainable_variables,
        )

    step, zero, made = tf.function(train_step), tf.function(zero_step), []
    for i in range(steps):
        step() if i % 2 == 0 else zero()
        promoted = opt.check_skips(batches=lambda: [(xb, yb)], loss=loss)
        if promoted:
            made += promoted
            step = tf.function(train_step)
    return made


def test_frequent_skips_promote_too():
    """SKIPS skips within 2 * SKIPS steps, never two in a row: promoted
    at the SKIPS-th skip (step 2 * SKIPS - 1), and the overflowing batch
    trains from then on."""
    model = tf_als.instrument(build())
    opt = optimizer()
    with pytest.warns(UserWarning, match="promoted layer 'temperature'"):
        made = _alternate(opt, model, steps=4 * SKIPS)
    assert [p.layer for p in made] == ["temperature"]
    assert made[0].step == SKIPS - 1  # the zero steps applied before it
    assert int(opt.iterations.numpy()) == 4 * SKIPS - SKIPS


def test_frequent_skips_that_cannot_be_promoted_warn_once():
    model = tf_als.instrument(build())
    opt = optimizer(promote_on_storm=False)
    with pytest.warns(UserWarning) as caught:
        _alternate(opt, model, steps=8 * SKIPS)
    messages = [str(w.message) for w in caught if "steps were skipped" in str(w.message)]
    assert len(messages) == 1, messages
    assert messages[0].startswith(
        f"{SKIPS} of the last {2 * SKIPS - 1} training steps were skipped"
    )
    assert tf_als.promoted(model) == []
    assert int(opt.iterations.numpy()) == 4 * SKIPS  # every zero step


def _check_with_the_loss(opt, xb, yb):
    return opt.check_skips(batches=lambda: [(xb, yb)], loss=loss_fn())


def test_a_compiled_custom_loop_promotes_with_the_loss():
    x, y = data()
    model = tf_als.instrument(build())
    opt = optimizer()
    promoted = custom_loop(
        model, opt, loss_fn(), x[:BATCH], y[:BATCH], 8, _check_with_the_loss
    )
    assert [p.layer for p in promoted] == ["temperature"]
    assert int(opt.iterations.numpy()) == 8 - SKIPS


def test_an_eager_loop_that_checks_promotes_too():
    """An eager loop that calls check_skips with batches takes the check
    over from `apply` (which has no batch to re-run)."""
    x, y = data()
    model = tf_als.instrument(build())
    opt = optimizer()
    promoted = custom_loop(
        model, opt, loss_fn(), x[:BATCH], y[:BATCH], 8, _check_with_the_loss,
        compiled=False,
    )
    assert [p.layer for p in promoted] == ["temperature"]
    assert int(opt.iterations.numpy()) == 8 - SKIPS


def test_an_eager_loop_that_does_not_check_stops_in_apply():
    x, y = data()
    model = tf_als.instrument(build())
    opt = optimizer()
    loss = loss_fn()
    with pytest.raises(tf_als.NonFiniteStormError, match="no training batches"):
        for _ in range(SKIPS):
            with tf.GradientTape() as tape:
                scaled = opt.scale_loss(loss(y[:BATCH], model(x[:BATCH], training=True)))
            grads = tape.gradient(scaled, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)


def test_a_custom_loop_without_the_loss_says_what_is_missing():
    x, y = data()
    model = tf_als.instrument(build())
    opt = optimizer()
    loss = loss_fn()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(loss(yb, model(xb, training=True)))
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

    with pytest.raises(tf_als.NonFiniteStormError, match="pass `loss=`"):
        for _ in range(SKIPS):
            step(x[:BATCH], y[:BATCH])
            opt.check_skips(batches=lambda: [x[:BATCH]])


def _oracle_cases():
    for case in architectures.ALL_CASES:
        marks = [pytest.mark.slow] if case.slow else []
        yield pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", _oracle_cases())
def test_no_healthy_model_has_a_layer_to_blame(case):
    """Promotion acts on what the eager searches blame, and only after
    `max_consecutive_skips` halvings of the global scale (from 2**15 to
    2**-17 at the default 32, where a healthy model's float16 gradients
    mostly underflow and none overflows). On every model of the gradient
    oracle, the searches blame nothing even at a unit loss scale, with
    the true gradients: a healthy run has nothing to promote."""
    _, mixed = case.build_pair()
    x, y = case.data()

    def loss(x, y, y_pred, sample_weight):
        return case.loss(y, y_pred)

    found = backward_search.first_non_finite_gradient(
        mixed, loss, (x, y, None), 1.0, training=case.training
    )
    assert found is None, found
    assert forward.first_non_finite_output(mixed, x, training=case.training) is None
