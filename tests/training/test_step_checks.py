"""The first-batch check in a model's own `train_step` and in custom loops
(issue 39, item 3): `optimizer.preflight(model, batches, step_loss=...)`,
called once before the first step with the loss the step differentiates,
checks what `fit` checks for Keras's own step. Shown on the GANs of
tests/loops.py, trained with `fit` on the GAN's own `train_step`, from the
same weights on the same batches as float32 and Keras's
`LossScaleOptimizer`."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tests import loops

STEPS = 12
BATCH = 8


def _gan(variant, generator, critic, penalty, **optimizer_kwargs):
    keras.mixed_precision.set_global_policy(
        "float32" if variant == "float32" else "mixed_float16"
    )
    generator, critic = generator(), critic()
    optimizers = []
    for _ in range(2):
        inner = keras.optimizers.Adam(1e-4)
        if variant == "float32":
            optimizers.append(inner)
        elif variant == "keras":
            optimizers.append(keras.optimizers.LossScaleOptimizer(inner))
        else:
            optimizers.append(tf_als.AdaptiveLossScaleOptimizer(inner, **optimizer_kwargs))
    if variant.startswith("tf_als"):
        generator, critic = tf_als.instrument(generator), tf_als.instrument(critic)
    gan = loops.GAN(generator, critic, penalty=penalty)
    gan.compile(d_optimizer=optimizers[0], g_optimizer=optimizers[1])
    return gan


def _check(gan, data):
    """The documented calls: each optimizer's check on the first batch,
    with the loss its step differentiates."""
    first = {k: v[:BATCH] for k, v in data.items()}
    critic = gan.d_optimizer.preflight(
        gan.critic, lambda: [first],
        step_loss=lambda b: gan.critic_loss(b["real"], b["z1"]),
    )
    generator = gan.g_optimizer.preflight(
        gan.generator, lambda: [first], step_loss=lambda b: gan.generator_loss(b["z2"])
    )
    return critic, generator


def _train(gan, data, skipped_before=(0, 0)):
    """(final losses, skipped steps of the critic's and the generator's
    optimizers, counting `skipped_before`)."""
    history = gan.fit(data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    steps = len(data["real"]) // BATCH
    skipped = tuple(
        before + steps - int(getattr(o, "inner_optimizer", o).iterations.numpy())
        for before, o in zip(skipped_before, (gan.d_optimizer, gan.g_optimizer))
    )
    return {k: v[-1] for k, v in history.history.items()}, skipped


@pytest.mark.parametrize("penalty", [0.0, 10.0], ids=["dcgan", "wgan_gp"])
def test_a_gans_own_step_gets_the_check_and_trains_like_float32(penalty):
    """A GAN on pixel values with a hand-written instance norm in its
    critic: the float16 norm overflows and outputs zeros, silently. The
    check on the critic's step loss promotes it before step 0, and the run
    ends where float32's does. Measured over 12 steps (critic loss at the
    end; skipped steps of the critic and the generator): DCGAN float32
    0.9219, Keras 1.0283 (0, 0), tf_als checked 0.9219 (0, 0); WGAN-GP
    float32 7.9559, Keras 8.4873 (1, 1), tf_als checked 7.9558 (0, 0)."""
    data = loops.pixel_images(STEPS * BATCH)

    def make(variant):
        return _gan(
            variant, lambda: loops.pixel_generator(1), lambda: loops.normalised_critic(2), penalty
        )

    reference, _ = _train(make("float32"), data)
    keras_losses, keras_skipped = _train(make("keras"), data)
    gan = make("tf_als")
    with pytest.warns(UserWarning, match="promoted layer 'norm'"):
        (critic_made, critic_why), (generator_made, _) = _check(gan, data)
    assert [p.layer for p in critic_made] == ["norm"] and critic_why is None
    assert [p.step for p in critic_made] == [0]
    assert generator_made == ()  # The generator's layers all work in float16.
    losses, skipped = _train(gan, data)
    assert skipped == (0, 0)
    assert all(s <= k for s, k in zip(skipped, keras_skipped))
    want = reference["d_loss"]
    # The premise: Keras's run, with the norm in float16, is off by 7-11%;
    # ours is float32's within float16's rounding (0.01% measured).
    assert abs(keras_losses["d_loss"] - want) > 0.05 * abs(want)
    assert abs(losses["d_loss"] - want) <= 0.01 * abs(want), (losses, reference)


def _wgan_gp(variant):
    generator = lambda: loops.mlp(loops.LATENT, 32, loops.FEATURES, "gen", seed=1)  # noqa: E731
    critic = lambda: loops.mlp(loops.FEATURES, 32, 1, "critic", "tanh", seed=2)  # noqa: E731
    return _gan(variant, generator, critic, 10.0)


def test_wgan_gp_checked_applies_its_first_step():
    """WGAN-GP's critic step (a gradient penalty: a gradient of a gradient)
    overflows at the default initial scale of 2**15 on its first batch:
    Keras skips that step. The check chooses 2**14, the largest scale at
    which the eager float16 pass is finite, and the first step applies.
    Measured over 12 steps (skipped steps of the critic and the
    generator): Keras (2, 0), tf_als without the check (2, 0), with it
    (1, 0), a later critic step."""
    data = loops.data(STEPS * BATCH)
    _, keras_skipped = _train(_wgan_gp("keras"), data)
    gan = _wgan_gp("tf_als")
    _check(gan, data)
    assert float(gan.d_optimizer.dynamic_scale.numpy()) == 2.0**14
    assert float(gan.g_optimizer.dynamic_scale.numpy()) == 2.0**15
    first = {k: v[:BATCH] for k, v in data.items()}
    rest = {k: v[BATCH:] for k, v in data.items()}
    _, skipped_first = _train(gan, first)
    assert skipped_first == (0, 0)  # Step 0 applied, both optimizers.
    _, skipped = _train(gan, rest)
    assert keras_skipped[0] >= 1  # The premise: the critic overflows.
    assert all(s <= k for s, k in zip(skipped, keras_skipped)), (skipped, keras_skipped)


def _bn_critic():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((loops.FEATURES,))
    x = keras.layers.Dense(16)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dropout(0.5)(keras.layers.ReLU()(x))
    return keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(x), name="bn_critic")


def test_the_check_leaves_every_model_the_loss_calls_as_it_found_it(mixed):
    """The generator's step loss runs the critic too (its BatchNormalization
    statistics and dropout seed move in training mode): the check puts
    back every variable of both."""
    generator = tf_als.instrument(loops.mlp(loops.LATENT, 16, loops.FEATURES, "gen", seed=1))
    critic = tf_als.instrument(_bn_critic())
    gan = loops.GAN(generator, critic)
    optimizer = tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam())
    batch = {k: v[:BATCH] for k, v in loops.data(BATCH).items()}
    variables = generator.variables + critic.variables
    before = [np.array(v.numpy()) for v in variables]
    optimizer.preflight(generator, lambda: [batch], step_loss=lambda b: gan.generator_loss(b["z2"]))
    moved = [v.path for v, b in zip(variables, before) if not np.array_equal(v.numpy(), b)]
    assert moved == []
    # The premise: the same loss, run once, moves the critic's statistics.
    gan.generator_loss(batch["z2"])
    assert any(
        not np.array_equal(v.numpy(), b) for v, b in zip(critic.variables, before[len(generator.variables):])
    )


def test_a_step_loss_must_call_the_model(mixed):
    model = tf_als.instrument(loops.mlp(loops.FEATURES, 8, 1, "critic"))
    optimizer = tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam())
    x = np.zeros((2, loops.FEATURES), "float32")
    with pytest.raises(ValueError, match="loss does not call model 'critic' itself"):
        optimizer.preflight(model, lambda: [x], step_loss=lambda b: tf.reduce_sum(b))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"loss": "mse", "step_loss": lambda b: 0.0}, ValueError, "not both"),
        ({"step_loss": "mse"}, TypeError, "`step_loss` must be callable; received 'mse'"),
        ({"loss": 3}, TypeError, "`loss` must be callable; received 3 of type int"),
    ],
)
def test_the_losses_are_checked(mixed, kwargs, error, message):
    model = tf_als.instrument(loops.mlp(loops.FEATURES, 8, 1, "critic"))
    optimizer = tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam())
    with pytest.raises(error, match=message):
        optimizer.preflight(model, lambda: [], **kwargs)
    with pytest.raises(error, match=message):
        optimizer.check_skips(batches=lambda: [], **kwargs)


def _nan_gan(max_consecutive_skips=4):
    """The DCGAN of tests/loops.py, both models instrumented, each with its
    own named optimizer; 48 batches whose real samples are NaN from the
    third batch on (the critic's loss is NaN there, the generator's is
    not)."""
    generator = tf_als.instrument(loops.mlp(loops.LATENT, 16, loops.FEATURES, "gen", seed=1))
    critic = tf_als.instrument(loops.mlp(loops.FEATURES, 16, 1, "critic", seed=2))
    gan = loops.GAN(generator, critic)
    optimizers = [
        tf_als.AdaptiveLossScaleOptimizer(
            keras.optimizers.Adam(1e-4), max_consecutive_skips=max_consecutive_skips,
            name=name,
        )
        for name in ("d_opt", "g_opt")
    ]
    gan.compile(d_optimizer=optimizers[0], g_optimizer=optimizers[1])
    data = loops.data(48 * BATCH)
    data["real"][2 * BATCH:] = np.nan
    return gan, data


def test_a_critic_storm_inside_gan_fit_stops_with_the_guard(mixed):
    """keras.io's GAN holds its optimizers as attributes of the model `fit`
    trains, which has no optimizer of its own: the guard finds them, and the
    critic's 4 skipped steps in a row stop `fit` with an error naming its
    optimizer and its model (and the non-finite loss), at batch 6; the
    generator's optimizer skipped nothing."""
    gan, data = _nan_gan()
    with pytest.raises(tf_als.NonFiniteStormError) as caught:
        gan.fit(
            data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
            callbacks=[tf_als.callbacks.NonFiniteGuard()],
        )
    message = str(caught.value)
    assert "'d_opt'" in message and "'critic'" in message, message
    assert "at batch 6" in message and "loss itself was not finite" in message, message
    assert int(gan.g_optimizer.iterations.numpy()) == 6
    assert int(gan.d_optimizer.iterations.numpy()) == 2


def test_the_guard_takes_the_optimizers_to_watch(mixed):
    """`optimizers=[...]` watches those only: the generator's optimizer,
    which skips nothing, lets the whole epoch run."""
    gan, data = _nan_gan()
    gan.fit(
        data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
        callbacks=[tf_als.callbacks.NonFiniteGuard(optimizers=[gan.g_optimizer])],
    )
    assert int(gan.g_optimizer.iterations.numpy()) == 48
    with pytest.raises(TypeError, match="wrap it"):
        tf_als.callbacks.NonFiniteGuard(optimizers=[keras.optimizers.Adam()])


class _OwnStep(keras.Model):
    """A model whose class defines its own `train_step`, as keras.io's DDIM
    does: it scales its loss with `optimizer.scale_loss`, applies, then
    updates a metric."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            prediction = tf.cast(self(x, training=True), "float32")
            loss = tf.reduce_mean(tf.square(prediction - y))
            scaled = self.optimizer.scale_loss(loss)
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(scaled, variables), variables)
        return {"loss": loss}


class _UnscaledStep(_OwnStep):
    """The same step without `scale_loss` (a mistake the check cannot see
    through)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(self(x, training=True), "float32") - y))
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"loss": loss}


def _own_step_model(cls, optimizer):
    """Dense(32) -> Dense(1) regressing targets near 300 from inputs near
    30: the first gradients, times S = 2**15, overflow float16, so a start
    at the initial scale skips steps until S has fallen."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    model = cls(inputs, keras.layers.Dense(1)(hidden), name="regressor")
    if isinstance(optimizer, tf_als.AdaptiveLossScaleOptimizer):
        model = tf_als.instrument(model)
    model.compile(optimizer=optimizer)
    rng = np.random.default_rng(0)
    x = (30.0 + rng.normal(size=(20 * BATCH, 8))).astype("float32")
    y = (300.0 + 10.0 * rng.normal(size=(20 * BATCH, 1))).astype("float32")
    return model, x, y


def _skipped(model, x):
    model.fit(x[0], x[1], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return len(x[0]) // BATCH - int(model.optimizer.iterations.numpy())


def test_fit_checks_the_first_batch_of_a_models_own_train_step(mixed):
    """Without a call from the user, `fit` runs the class's own step on
    the first batch (ended at its `scale_loss`, nothing applied) and sets
    S where its gradients are finite: tf_als skips no step where Keras's
    LossScaleOptimizer, from the same weights on the same batches, skips
    several while its scale falls, and its weights end closer to float32's
    (same weights, same batches)."""
    keras_model, *data = _own_step_model(
        _OwnStep, keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-6))
    )
    als_model, *_ = _own_step_model(
        _OwnStep, tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-6))
    )
    keras.mixed_precision.set_global_policy("float32")
    float32_model, *_ = _own_step_model(_OwnStep, keras.optimizers.SGD(1e-6))
    keras.mixed_precision.set_global_policy("mixed_float16")
    assert _skipped(float32_model, data) == 0
    assert _skipped(keras_model, data) >= 3  # The premise.
    assert _skipped(als_model, data) == 0
    assert float(als_model.optimizer.dynamic_scale.numpy()) < 2.0**15

    def distance(model):  # Largest weight difference to float32's.
        return max(
            float(np.max(np.abs(w.numpy() - r.numpy())))
            for w, r in zip(model.weights, float32_model.weights)
        )

    # Every step applied, as float32's: far closer than Keras's run.
    assert distance(als_model) < distance(keras_model) / 4


def test_a_step_that_applies_without_scaling_gets_a_warning_not_a_check(mixed):
    model, *data = _own_step_model(
        _UnscaledStep, tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-6))
    )
    with pytest.warns(UserWarning, match="fit ran no first-batch check.*without handing its loss"):
        model.fit(data[0][:BATCH], data[1][:BATCH], batch_size=BATCH, verbose=0)
    # The check applied nothing: only fit's one step did.
    assert int(model.optimizer.iterations.numpy()) <= 1


class _Wrapper(keras.Model):
    """keras.io's DDIM shape: the model `fit` runs is not instrumented; it
    holds the instrumented network its own `train_step` trains."""

    def __init__(self, network, **kwargs):
        super().__init__(**kwargs)
        self.network = network

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            prediction = tf.cast(self.network(x, training=True), "float32")
            loss = tf.reduce_mean(tf.square(prediction - y))
            scaled = self.optimizer.scale_loss(loss)
        variables = self.network.trainable_variables
        self.optimizer.apply(tape.gradient(scaled, variables), variables)
        return {"loss": loss}


def _wrapped():
    network, x, y = _own_step_model(keras.Model, keras.optimizers.SGD(1e-6))
    wrapper = _Wrapper(tf_als.instrument(network))
    wrapper.compile(optimizer=tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-6)))
    return wrapper, x, y


def test_a_wrapper_that_fit_cannot_check_is_told_which_call_to_make(mixed):
    """`fit` cannot reach the first batch of a model it does not run: the
    first traced step warns and names `preflight`. After that call, no
    warning, and the step skips fewer (the premise: the unchecked run skips
    steps, as Keras's would)."""
    wrapper, x, y = _wrapped()
    with pytest.warns(UserWarning, match="without the first-batch check.*preflight"):
        unchecked = _skipped(wrapper, (x, y))
    assert unchecked >= 3
    wrapper, x, y = _wrapped()
    wrapper.optimizer.preflight(
        wrapper.network,
        lambda: [(x[:BATCH], y[:BATCH])],
        step_loss=lambda batch: tf.reduce_mean(
            tf.square(tf.cast(wrapper.network(batch[0], training=True), "float32") - batch[1])
        ),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checked = _skipped(wrapper, (x, y))
    assert not [w for w in caught if "first-batch check" in str(w.message)]
    assert checked < unchecked


def test_fit_of_an_instrumented_model_does_not_warn_of_a_missing_check(mixed):
    model, x, y = _own_step_model(
        _OwnStep, tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-6))
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _skipped(model, (x, y))
    assert not [w for w in caught if "first-batch check" in str(w.message)]


class _CallingWrapper(_Wrapper):
    """The wrapper given a `call` (so that it can be instrumented), whose
    step still calls `self.network` directly."""

    def call(self, x, training=None):
        return self.network(x, training=training)


def test_an_instrumented_wrapper_whose_step_bypasses_it_warns_not_fails(mixed):
    """Instrumenting the wrapper does not reach the network its step calls
    directly: `fit` says so and trains on (it raised a ValueError)."""
    network, x, y = _own_step_model(keras.Model, keras.optimizers.SGD(1e-6))
    wrapper = _CallingWrapper(network)
    wrapper(x[:1])
    wrapper = tf_als.instrument(wrapper)
    wrapper.compile(optimizer=tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-6)))
    with pytest.warns(UserWarning, match="fit ran no first-batch check.*instrument the model the step calls"):
        wrapper.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)
    assert int(wrapper.optimizer.iterations.numpy()) <= 1
