"""The GAN step of tests/loops.py under `tf.distribute.MirroredStrategy` on
two logical CPUs, run as a separate process by
`tests/training/test_distribute.py::test_a_gan_on_two_replicas` (logical devices
must be configured before TensorFlow initialises its devices).

    python -m tests.distributed_gan

trains the same instrumented generator and critic, each with its own
`AdaptiveLossScaleOptimizer`, twice from the same weights on the same
global batches: with the default strategy and under MirroredStrategy. It
prints one JSON object: both runs' final weights, scales and optimizer
steps, and every scaling point's variables as each replica holds them.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tests.distributed_run import _configure_devices  # noqa: E402

STEPS = 6
GLOBAL_BATCH = 16
INTERVAL = 2


def _train(strategy, weights):
    import keras

    import tf_als
    from tests import loops

    keras.backend.clear_session(free_memory=False)
    keras.mixed_precision.set_global_policy("mixed_float16")
    with strategy.scope():
        generator = tf_als.instrument(loops.mlp(loops.LATENT, 16, loops.FEATURES, "gen", seed=1))
        critic = tf_als.instrument(loops.mlp(loops.FEATURES, 16, 1, "critic", "tanh", seed=2))
        if weights is not None:
            generator.uninstrumented().set_weights(weights["generator"])
            critic.uninstrumented().set_weights(weights["critic"])
        gan = loops.GAN(generator, critic)

        def optimizer():
            return tf_als.AdaptiveLossScaleOptimizer(
                keras.optimizers.SGD(0.05), telemetry_interval=INTERVAL
            )

        gan.compile(d_optimizer=optimizer(), g_optimizer=optimizer())
        # Keras builds a model without `call` (the GAN) and optimizers it
        # does not know of only outside a strategy: build them here, in
        # the scope, as a MirroredStrategy user must with Keras alone.
        gan.d_optimizer.build(critic.trainable_variables)
        gan.g_optimizer.build(generator.trainable_variables)
        gan.built = True
    initial = {
        "generator": generator.uninstrumented().get_weights(),
        "critic": critic.uninstrumented().get_weights(),
    }
    gan.fit(
        loops.data(STEPS * GLOBAL_BATCH), batch_size=GLOBAL_BATCH,
        shuffle=False, verbose=0,
    )
    return gan, initial


def _summary(gan, initial):
    import numpy as np

    import tf_als

    result = {}
    for name, model, optimizer in (
        ("generator", gan.generator, gan.g_optimizer),
        ("critic", gan.critic, gan.d_optimizer),
    ):
        state = model.scaling_state
        replicas = {}
        for variable in ("scales", "last_updates", "due"):
            value = getattr(state, variable).value
            components = getattr(value, "values", None) or (value,)
            replicas[variable] = [np.asarray(v).tolist() for v in components]
        result[name] = {
            "weights": [np.asarray(w).tolist() for w in model.uninstrumented().get_weights()],
            "initial": [np.asarray(w).tolist() for w in initial[name]],
            "scales": tf_als.scales(model),
            "iterations": int(np.asarray(optimizer.iterations)),
            "replicas": replicas,
        }
    return result


def main():
    devices = _configure_devices(2)
    import tensorflow as tf

    single, initial = _train(tf.distribute.get_strategy(), None)
    mirrored, _ = _train(tf.distribute.MirroredStrategy(devices), initial)
    print(json.dumps(
        {"single": _summary(single, initial), "mirrored": _summary(mirrored, initial)}
    ))


if __name__ == "__main__":
    main()
