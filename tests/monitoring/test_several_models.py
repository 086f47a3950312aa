"""`ScaleHistory` on a `fit` that trains several instrumented models with
their own optimizers: keras.io's GANs, whose wrapper model holds a
generator and a discriminator (tests/loops.py's DCGAN)."""

import os

import keras
import numpy as np
import pytest

import tf_als
from tests import loops

BATCH = 8
STEPS = 6


def _gan():
    generator = tf_als.instrument(loops.mlp(loops.LATENT, 16, loops.FEATURES, "gen", seed=1))
    critic = tf_als.instrument(loops.mlp(loops.FEATURES, 16, 1, "critic", seed=2))
    gan = loops.GAN(generator, critic)
    gan.compile(
        d_optimizer=tf_als.AdaptiveLossScaleOptimizer(
            keras.optimizers.Adam(1e-4), telemetry_interval=2, name="d_opt"
        ),
        g_optimizer=tf_als.AdaptiveLossScaleOptimizer(
            keras.optimizers.Adam(1e-4), telemetry_interval=3, name="g_opt"
        ),
    )
    return gan


def test_a_gan_fit_records_each_model_with_its_own_optimizer(mixed, tmp_path):
    """Found among the GAN's layers, each model is recorded at its own
    optimizer's telemetry steps (every 2 steps for the critic, every 3 for
    the generator), its scales read from its own state; the epoch logs
    carry each model's global scale; TensorBoard gets a run per model."""
    gan = _gan()
    history = tf_als.callbacks.ScaleHistory(log_dir=str(tmp_path))
    result = gan.fit(
        loops.data(STEPS * BATCH), batch_size=BATCH, epochs=1, shuffle=False,
        verbose=0, callbacks=[history],
    )
    assert set(history.history) == {"gen", "critic"}
    assert history.history["critic"]["step"] == [0, 2, 4]
    assert history.history["gen"]["step"] == [0, 3]
    for model in (gan.generator, gan.critic):
        recorded = history.history[model.name]
        assert list(recorded["points"]) == [p.point_name for p in model.scaling_points]
        # The last record of each point is what its optimizer wrote at its
        # last telemetry step (records are written on those steps only).
        last = {name: values for name, values in zip(
            model.scaling_state.point_names, model.scaling_state.read()
        )}
        for name, values in recorded["points"].items():
            assert values["amax"][-1] == last[name][0]["amax"]
            assert values["amax"][-1] > 0
    scales = {
        "gen": float(gan.g_optimizer.dynamic_scale.numpy()),
        "critic": float(gan.d_optimizer.dynamic_scale.numpy()),
    }
    for name, scale in scales.items():
        assert result.history[f"{name}_loss_scale"] == [scale]
        assert os.listdir(tmp_path / name) == ["tf_als"]


def test_models_can_be_named_and_a_wrapper_without_them_is_refused(mixed):
    gan = _gan()
    history = tf_als.callbacks.ScaleHistory(models=[gan.critic])
    gan.fit(
        loops.data(2 * BATCH), batch_size=BATCH, epochs=1, shuffle=False,
        verbose=0, callbacks=[history],
    )
    assert history.history["step"] == [0]  # One model: the usual structure.
    assert list(history.history["points"]) == [p.point_name for p in gan.critic.scaling_points]

    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="plain")
    with pytest.raises(TypeError, match=r"ScaleHistory\(models=\[generator, discriminator\]\)"):
        tf_als.callbacks.ScaleHistory().set_model(plain)
    with pytest.raises(TypeError, match="instrument it"):
        tf_als.callbacks.ScaleHistory(models=[plain])
