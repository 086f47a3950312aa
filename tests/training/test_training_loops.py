"""The training loops Keras users write (tests/loops.py), trained four ways
where the result is a number: float32, Keras's `LossScaleOptimizer` on the
plain float16 models, tf_als (models instrumented, one
`AdaptiveLossScaleOptimizer` per optimizer), all from the same weights on
the same batches.

Tolerances on final losses: the runs are short (8-16 steps of SGD at
0.01) so that float16 rounding, not chaos, separates them. Measured here
(TF 2.21, CPU), the float16 runs' final losses differ from float32's by
at most 0.41% (WGAN-GP's generator loss, 0.025, near zero), 0.3% (its
critic loss), 0.13% (VAE), 0.004% (DCGAN, distiller), Keras's and tf_als's
alike; the bound of 2% leaves a factor of five. A gradient off by a power
of two (a wrong unscale) changes every SGD update by 50% or more, and
these runs' losses move by 10-30% in their 8-16 steps.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tests import loops
from tests.modes import JIT_COMPILE, compiled

LOSS_TOLERANCE = 0.02
VARIANTS = ("float32", "keras", "tf_als")


def _policy(variant):
    keras.mixed_precision.set_global_policy(
        "float32" if variant == "float32" else "mixed_float16"
    )


# A global scale no first step overflows, for Keras and tf_als alike:
# with the default 2**15 both skip their first steps on these losses (the
# VAE's sum of squares, the GAN's), and the runs would then be compared
# with a float32 run that applied more steps. Skipping is tested elsewhere
# (tests/failures/test_storms.py); these tests compare what the loops apply.
INITIAL_SCALE = 2.0**8


def _optimizer(variant, **kwargs):
    # SGD, not Adam: Adam's update hardly changes when a gradient is off by
    # a constant factor, SGD's changes in proportion.
    inner = keras.optimizers.SGD(0.01, **kwargs)
    if variant == "float32":
        return inner
    if variant == "keras":
        return keras.optimizers.LossScaleOptimizer(inner, initial_scale=INITIAL_SCALE)
    return tf_als.AdaptiveLossScaleOptimizer(
        inner, initial_scale=INITIAL_SCALE, telemetry_interval=2
    )


def _model(variant, build):
    model = build()
    return tf_als.instrument(model) if variant == "tf_als" else model


def _updated(model) -> bool:
    """Whether an update chose the scales of `model`'s points."""
    return bool((np.asarray(model.scaling_state.last_updates) >= 0).all())


# -- a model's own train_step ---------------------------------------------


def _counting(variant="tf_als", name=None):
    _policy(variant)
    keras.utils.set_random_seed(0)
    model = loops.CountingModel(name=name)
    model(np.zeros((1, loops.FEATURES), "float32"))
    return _model(variant, lambda: model)


def _regression(count=64):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(count, loops.FEATURES)).astype("float32")
    return x, (x[:, :1] * 3.0 - 1.0).astype("float32")


def test_the_models_own_train_step_runs_on_every_batch():
    model = _counting()
    model.compile(optimizer=_optimizer("tf_als"), loss="mse", jit_compile=False)
    x, y = _regression()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(model.steps_run.numpy()) == 8  # The original's counter.
    assert _updated(model)


def test_fit_ends_bitwise_where_the_same_step_run_by_hand_ends():
    x, y = _regression()
    by_fit, by_hand = _counting(), _counting()
    for model in (by_fit, by_hand):
        model.compile(optimizer=_optimizer("tf_als"), loss="mse", jit_compile=False)
    by_fit.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    step = tf.function(by_hand.train_step)
    for i in range(0, len(x), 8):
        step((tf.constant(x[i : i + 8]), tf.constant(y[i : i + 8])))
    for a, b in zip(by_fit.trainable_variables, by_hand.trainable_variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert list(tf_als.scales(by_fit).values()) == list(tf_als.scales(by_hand).values())


def test_methods_and_attributes_of_the_users_class_stay_reachable():
    model = _counting()
    assert model.hidden is model.uninstrumented().hidden  # The same layer.
    x = np.ones((2, loops.FEATURES), "float32")
    np.testing.assert_array_equal(model.predict_twice(x), model.uninstrumented()(x) * 2.0)
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        model.missing


def test_a_model_named_with_a_leading_underscore():
    model = _counting(name="_my_model")
    model.compile(optimizer=_optimizer("tf_als"), loss="mse", jit_compile=False)
    x, y = _regression(16)
    model.fit(x, y, batch_size=8, verbose=0)
    assert model.name == "my_model"
    assert int(model.steps_run.numpy()) == 2


class _Base(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)
        self.calls = keras.Variable(0, dtype="int32", trainable=False)

    def call(self, x):
        return self.dense(x)


class _ExtendsKerasStep(_Base):
    def train_step(self, data):
        self.calls.assign_add(1)
        return super().train_step(data)  # Keras's own step.


class _ExtendsUserStep(_ExtendsKerasStep):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.outer_calls = keras.Variable(0, dtype="int32", trainable=False)

    def train_step(self, data):
        self.outer_calls.assign_add(1)
        return super().train_step(data)  # _ExtendsKerasStep's.


def test_a_train_step_that_calls_super_reaches_keras_step(mixed):
    model = _ExtendsKerasStep()
    model(np.zeros((1, 3), "float32"))
    model = tf_als.instrument(model)
    model.compile(optimizer=_optimizer("tf_als"), loss="mse", jit_compile=False)
    model.fit(np.ones((16, 3)), np.ones((16, 4)), batch_size=8, verbose=0)
    assert int(model.calls.numpy()) == 2
    assert _updated(model)


def test_super_chains_through_the_users_classes(mixed):
    """`_ExtendsUserStep.train_step` -> `_ExtendsKerasStep.train_step` ->
    Keras's: every class's step runs once a batch, on the instrumented
    model, and Keras's step trains through the scaling points."""
    model = _ExtendsUserStep()
    model(np.zeros((1, 3), "float32"))
    model = tf_als.instrument(model)
    assert isinstance(model, _ExtendsUserStep)
    model.compile(optimizer=_optimizer("tf_als"), loss="mse", jit_compile=False)
    model.fit(np.ones((16, 3)), np.ones((16, 4)), batch_size=8, verbose=0)
    assert (int(model.outer_calls.numpy()), int(model.calls.numpy())) == (2, 2)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert _updated(model)


# -- GANs: two models, two optimizers, a critic inside the generator's step --


def _gan(variant, penalty=0.0, critic="mlp"):
    _policy(variant)
    generator = _model(variant, lambda: loops.mlp(loops.LATENT, 32, loops.FEATURES, "gen", seed=1))
    build = {"mlp": loops.mlp, "composite": loops.composite_mlp}[critic]
    critic = _model(variant, lambda: build(loops.FEATURES, 32, 1, "critic", "tanh", seed=2))
    gan = loops.GAN(generator, critic, penalty=penalty)
    gan.compile(d_optimizer=_optimizer(variant), g_optimizer=_optimizer(variant))
    return gan


def _train_gan(variant, penalty, jit_compile, steps=16):
    gan = _gan(variant, penalty)
    gan.jit_compile = jit_compile
    history = gan.fit(loops.data(steps * 8), batch_size=8, epochs=1, shuffle=False, verbose=0)
    return gan, {k: v[-1] for k, v in history.history.items()}


@pytest.mark.parametrize("penalty", [0.0, 10.0], ids=["dcgan", "wgan_gp"])
@pytest.mark.parametrize("jit_compile", JIT_COMPILE)
def test_a_gan_trains_like_float32(penalty, jit_compile):
    results = {v: _train_gan(v, penalty, jit_compile) for v in VARIANTS}
    gan, losses = results["tf_als"]
    # Both optimizers applied every step ...
    assert int(gan.d_optimizer.iterations.numpy()) == 16
    assert int(gan.g_optimizer.iterations.numpy()) == 16
    # ... each updated the scales of its own model, and only those ...
    assert _updated(gan.generator) and _updated(gan.critic)
    assert gan.generator.trained_by() == [gan.g_optimizer]
    assert gan.critic.trained_by() == [gan.d_optimizer]
    # ... and the losses are float32's, as closely as Keras's.
    for name in ("d_loss", "g_loss"):
        reference = results["float32"][1][name]
        for variant in ("keras", "tf_als"):
            value = results[variant][1][name]
            assert abs(value - reference) <= LOSS_TOLERANCE * abs(reference), (
                variant, name, value, reference,
            )


def test_the_generator_gradient_through_a_scaled_critic_is_float32s():
    """The critic's points keep their scales (up to 2**6 here) in the
    generator's step, where its variables are not trained; the generator
    must still receive its float32 gradient."""
    real = loops.data(8)
    gradients = {}
    for variant in ("float32", "tf_als"):
        gan = _gan(variant)
        if variant == "tf_als":
            for i, point in enumerate(gan.critic.scaling_points):
                point.scale.assign(2.0 ** (2 * i))
        with tf.GradientTape() as tape:
            loss = gan.generator_loss(real["z2"])
        variables = gan.generator.trainable_weights
        gradients[variant] = tape.gradient(loss, variables)
    for got, want in zip(gradients["tf_als"], gradients["float32"]):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        # float16 arithmetic in both models: rounding of a few 2**-11.
        assert np.linalg.norm(got - want) <= 0.01 * np.linalg.norm(want)


@pytest.mark.parametrize("critic", ["mlp", "composite"])
@pytest.mark.parametrize("mode", ["eager", "tf_function", pytest.param("xla", marks=pytest.mark.slow)])
def test_a_gradient_penalty_gives_the_optimizer_float32s_gradient(mode, critic):
    """WGAN-GP's critic loss, penalty included (a gradient of a gradient
    through every scaling point, a composite's inner points too),
    differentiated for the critic's weights.
    The criterion of tests/test_oracle.py: norm ratio and cosine against
    float32, and a relative error no worse than twice Keras's plus float16
    rounding."""
    # Tensors, as `fit` hands a step its batch. With numpy arrays, one slow
    # run (xdist worker order of 2026-12-04) failed tracing `real + ...`
    # under XLA ("Cannot convert a symbolic tf.Tensor"); alone it passes.
    batch = {k: tf.constant(v) for k, v in loops.data(16).items()}
    gradients = {}
    for variant in VARIANTS:
        gan = _gan(variant, penalty=10.0, critic=critic)
        if variant == "tf_als":
            for i, point in enumerate(gan.critic.scaling_points):
                point.scale.assign(2.0 ** (2 * i))  # Lifted, unequal scales.

        def loss_gradients():
            with tf.GradientTape() as tape:
                loss = gan.critic_loss(batch["real"], batch["z1"])
                scaled = loss * 16.0  # A global scale, as S is.
            variables = gan.critic.trainable_weights
            return [tf.cast(g, tf.float32) / 16.0 for g in tape.gradient(scaled, variables)]

        gradients[variant] = [np.asarray(g, np.float64) for g in compiled(loss_gradients, mode)()]
    for als, ker, want in zip(gradients["tf_als"], gradients["keras"], gradients["float32"]):
        norm = np.linalg.norm(want)
        if norm == 0.0:  # The head's bias: the loss does not depend on it.
            assert np.abs(als).max() <= 1e-6 and np.abs(ker).max() <= 1e-6
            continue
        assert abs(np.linalg.norm(als) / norm - 1.0) <= 0.01
        assert np.dot(als.ravel(), want.ravel()) / (np.linalg.norm(als) * norm) >= 0.999
        keras_error = np.linalg.norm(ker - want) / norm
        assert np.linalg.norm(als - want) / norm <= 2 * keras_error + 2.0**-10


@pytest.mark.parametrize("critic", ["mlp", "composite"])
@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_points_lift_their_inputs_only_where_a_gradient_of_a_gradient_can_be_taken(
    mode, critic, monkeypatch
):
    """A point's input lifts serve only a second-order gradient. Under the
    one non-persistent tape of a first-order step (Keras's train step, a
    custom loop's) the points make none; under the critic loss's two tapes
    (its gradient penalty) every critic point lifts its input, a
    composite's inner points too, and the penalty's gradient through them
    is float32's (the test above)."""
    from tf_als._src.training import backward

    made = []
    original = backward._lift
    monkeypatch.setattr(
        backward, "_lift", lambda *args: made.append(args[1]) or original(*args)
    )
    gan = _gan("tf_als", penalty=10.0, critic=critic)
    batch = {k: tf.constant(v) for k, v in loops.data(16).items()}
    critic_points = len(gan.critic.scaling_points)

    def step(loss_of):
        def run():
            with tf.GradientTape() as tape:
                loss = loss_of()
            return tape.gradient(loss, gan.critic.trainable_weights)

        made.clear()
        compiled(run, mode)()
        return sorted(set(made))

    # First order: the critic's score of real data, one tape.
    assert step(lambda: tf.reduce_mean(gan.critic(batch["real"], training=True))) == []
    # Second order: the penalty differentiates the critic's input gradient.
    lifted = step(lambda: gan.critic_loss(batch["real"], batch["z1"]))
    assert len(lifted) == critic_points, (lifted, critic_points)


# -- a VAE: one optimizer, two instrumented models ---------------------------


def test_a_vae_trains_both_models_with_one_optimizer():
    finals = {}
    for variant in VARIANTS:
        _policy(variant)
        encoder = _model(variant, lambda: loops.mlp(loops.FEATURES, 32, 2 * loops.LATENT, "enc", seed=3))
        decoder = _model(variant, lambda: loops.mlp(loops.LATENT, 32, loops.FEATURES, "dec", seed=4))
        vae = loops.VAE(encoder, decoder)
        vae.compile(optimizer=_optimizer(variant), jit_compile=False)
        history = vae.fit(loops.data(64), batch_size=8, shuffle=False, verbose=0)
        finals[variant] = history.history["loss"][-1]
        if variant == "tf_als":
            assert _updated(encoder) and _updated(decoder)
            assert encoder.trained_by() == decoder.trained_by() == [vae.optimizer]
            assert int(vae.optimizer.iterations.numpy()) == 8
    for variant in ("keras", "tf_als"):
        assert abs(finals[variant] - finals["float32"]) <= LOSS_TOLERANCE * finals["float32"]


# -- distillation: a frozen, uninstrumented teacher ------------------------


def test_distillation_from_a_plain_teacher():
    batch = loops.data(64)
    batch["label"] = (batch["real"][:, 0] > 0).astype("int32")
    finals = {}
    for variant in VARIANTS:
        _policy(variant)
        teacher = loops.mlp(loops.FEATURES, 32, 2, "teacher", seed=5)
        student = _model(variant, lambda: loops.mlp(loops.FEATURES, 16, 2, "student", seed=6))
        distiller = loops.Distiller(student, teacher)
        distiller.compile(optimizer=_optimizer(variant), jit_compile=False)
        finals[variant] = distiller.fit(batch, batch_size=8, shuffle=False, verbose=0).history["loss"][-1]
        if variant == "tf_als":
            assert _updated(student)
    for variant in ("keras", "tf_als"):
        assert abs(finals[variant] - finals["float32"]) <= LOSS_TOLERANCE * finals["float32"]


# -- fit's other knobs -------------------------------------------------------


def _plain_model(variant="tf_als"):
    return _model(variant, lambda: loops.mlp(loops.FEATURES, 16, 1, "net", seed=7))


def test_steps_per_execution_trains_as_one_step_at_a_time(mixed):
    x, y = _regression()
    models = {}
    for steps in (1, 4):
        model = _plain_model()
        model.compile(
            optimizer=_optimizer("tf_als"), loss="mse",
            steps_per_execution=steps, jit_compile=False,
        )
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        models[steps] = model
    # Updates on steps 0, 2, 4, 6 in both.
    assert np.asarray(models[4].scaling_state.last_updates).tolist() == [6, 6, 6]
    for a, b in zip(models[1].trainable_variables, models[4].trainable_variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert list(tf_als.scales(models[1]).values()) == list(tf_als.scales(models[4]).values())


def test_gradient_accumulation_records_and_updates_on_the_applying_steps_only(mixed):
    """Four micro-batches per applied step (batches 3 and 7 apply, as
    applied steps 0 and 1). The telemetry is recorded on those batches
    only; under the paper's rule (`update_interval=1`), the backward pass
    of each applying batch updates the scales (`due` is 1 after the batch
    before it), and they change at those batches only."""
    x, y = _regression()
    model = _plain_model()
    optimizer = tf_als.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-3, gradient_accumulation_steps=4),
        rule="paper", update_interval=1, telemetry_interval=1,
    )
    model.compile(optimizer=optimizer, loss=lambda t, p: tf.reduce_mean((t - p) ** 2) * 2.0**-14, jit_compile=False)
    seen = []

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            state = model.scaling_state
            seen.append((int(state.due.numpy()), list(tf_als.scales(model).values()),
                         np.asarray(state.last_updates).tolist()))

    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[Watch()])
    assert [due for due, _, _ in seen] == [0, 0, 1, 0, 0, 0, 1, 0]
    assert [updates[0] for _, _, updates in seen] == [-1, -1, -1, 0, 0, 0, 0, 1]
    # The scales change only at the applying batches: the small loss makes
    # the first update lift them.
    scales = [s for _, s, _ in seen]
    assert scales[0] == scales[1] == scales[2] == [1.0, 1.0, 1.0]
    assert scales[3] == scales[4] == scales[5] == scales[6] != scales[2]


