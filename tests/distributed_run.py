"""One training scenario under `tf.distribute`, run as a separate process by
`tests/training/test_distribute.py` (logical devices must be configured before
TensorFlow initialises its devices, which the test process has long done).

    python -m tests.distributed_run {fit,loop} --replicas 2

trains the same instrumented model twice in this process, from the same
initial weights on the same global batches in the same order: once with
TensorFlow's default (single-device) strategy and once under a
`MirroredStrategy` over `--replicas` logical CPU devices; it prints one JSON
object (one line on stdout) with the initial weights, both runs' final
weights, `tf_als.scales`, optimizer state, and the per-replica values of
every scaling point's variables after every step.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

STEPS = 6  # one epoch of 6 global batches
INTERVAL = 2  # telemetry is recorded at steps 0, 2 and 4
GLOBAL_BATCH = 16  # 8 examples per replica
# A low ceiling: the head's point reaches it on the second replica, whose
# gradients are smaller, and not on the first, so the replicas' scales
# differ (with the default 2**15 the head alone would take all the
# headroom on both).
MAX_LAYER_SCALE = 2.0**3
FEATURES = 12
CLASSES = 5
# The loss is scaled by 2**-12 (see `small_loss`); a learning rate of 2**11
# makes the updates those of SGD(0.5) on the plain cross-entropy, so the
# weights move visibly in a few steps.
LEARNING_RATE = 2.0**11


def _configure_devices(replicas):
    import tensorflow as tf

    (cpu,) = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * replicas
    )
    # Single-threaded kernels: the replicas' float16 sums then depend on the
    # data only, not on how a kernel split its work across threads.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def build():
    """A small residual MLP: Dense -> BatchNormalization -> ReLU, a residual
    fork around a Dense, then a float32 head. BatchNormalization is
    `synchronized`: unsynchronized, each replica would normalise with the
    statistics of its half batch, a different function from the
    single-device one."""
    import keras

    layers = keras.layers
    inputs = keras.Input((FEATURES,))
    x = layers.Dense(16, use_bias=False)(inputs)
    x = layers.BatchNormalization(synchronized=True)(x)
    x = layers.ReLU()(x)
    y = layers.Dense(16, activation="relu")(x)
    x = layers.Add()([x, y])
    outputs = layers.Dense(CLASSES, dtype="float32")(x)
    return keras.Model(inputs, outputs, name="residual_bn")


def data():
    """(x, y, sample weights): the first half of every global batch (the
    first replica's) weighs 1, the second 2**-4, so that the replicas'
    gradients differ by about that factor and their points choose
    different scales from them (weights of 2**4 and 1 instead made even
    Keras's own mirrored run drift 2% from its single-device run in six
    steps at this learning rate)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(STEPS * GLOBAL_BATCH,)).astype("int32")
    half = np.arange(STEPS * GLOBAL_BATCH) % GLOBAL_BATCH < GLOBAL_BATCH // 2
    weights = np.where(half, 1.0, 2.0**-4).astype("float32")
    return x, y, weights


def small_loss():
    """Cross-entropy times 2**-12, so that per-layer scales leave 1. A
    `keras.losses.Loss` divides by the number of replicas in sync, so the
    gradients summed over replicas are the global batch mean's."""
    import keras

    class SmallLoss(keras.losses.Loss):
        def call(self, y_true, y_pred):
            cross_entropy = keras.losses.sparse_categorical_crossentropy(
                y_true, y_pred, from_logits=True
            )
            return cross_entropy * 2.0**-12

    return SmallLoss()


def _per_replica(strategy, model):
    """Every scaling point's variables as each replica holds them."""
    import numpy as np

    result = []
    for point in model.scaling_points:
        values = {}
        for name in ("scale", "record", "last_update"):
            values[name] = [
                np.asarray(v).tolist() for v in getattr(point, name).replica_values()
            ]
        result.append(values)
    return result


COLLECTIVES = []


def _count_collectives():
    """Records every replica-context all-gather and all-reduce as it is
    traced: its kind, the graph it is traced into and its value shapes."""
    import tensorflow as tf

    context_class = tf.distribute.ReplicaContext
    for kind in ("all_gather", "all_reduce"):
        original = getattr(context_class, kind)

        def counted(self, *args, _original=original, _kind=kind, **kwargs):
            values = [
                v for v in tf.nest.flatten((args, kwargs)) if tf.is_tensor(v)
            ]
            COLLECTIVES.append(
                {
                    "kind": _kind,
                    "graph": str(getattr(tf.compat.v1.get_default_graph(), "name", "")),
                    "shapes": [v.shape.as_list() for v in values],
                }
            )
            return _original(self, *args, **kwargs)

        setattr(context_class, kind, counted)


def _make(strategy, initial_weights):
    import keras

    import tf_als

    keras.backend.clear_session(free_memory=False)  # same layer names
    keras.mixed_precision.set_global_policy("mixed_float16")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = tf_als.instrument(build())
        model.uninstrumented().set_weights(initial_weights)
        optimizer = tf_als.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(LEARNING_RATE),
            telemetry_interval=INTERVAL,
            max_layer_scale=MAX_LAYER_SCALE,
        )
    return model, optimizer


def train_fit(strategy, initial_weights):
    import keras

    model, optimizer = _make(strategy, initial_weights)
    per_step = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            per_step.append(_per_replica(strategy, model))

    with strategy.scope():
        model.compile(optimizer=optimizer, loss=small_loss())
    x, y, weights = data()
    model.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=GLOBAL_BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[Record()],
    )
    return model, optimizer, per_step


def train_loop(strategy, initial_weights):
    import tensorflow as tf

    model, optimizer = _make(strategy, initial_weights)
    loss = small_loss()
    variables = model.trainable_variables
    with strategy.scope():
        # The points choose with the optimizer's knobs (max_layer_scale).
        model.compile(optimizer=optimizer)
        optimizer.build(variables)
    x, y, weights = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(GLOBAL_BATCH)
    dataset = strategy.experimental_distribute_dataset(dataset)

    def step(batch_x, batch_y, batch_weights):
        with tf.GradientTape() as tape:
            value = loss(
                batch_y, model(batch_x, training=True), sample_weight=batch_weights
            )
            scaled = optimizer.scale_loss(value)
        optimizer.apply(tape.gradient(scaled, variables), variables)

    @tf.function
    def distributed_step(batch_x, batch_y, batch_weights):
        strategy.run(step, args=(batch_x, batch_y, batch_weights))

    per_step = []
    for batch_x, batch_y, batch_weights in dataset:
        distributed_step(batch_x, batch_y, batch_weights)
        per_step.append(_per_replica(strategy, model))
    return model, optimizer, per_step


def summary(model, optimizer, per_step):
    import numpy as np

    import tf_als

    return {
        "weights": [np.asarray(v).tolist() for v in model.uninstrumented().get_weights()],
        "weight_names": [v.path for v in model.uninstrumented().weights],
        "trainable_shapes": [list(v.shape) for v in model.trainable_variables],
        "scales": tf_als.scales(model),
        "states": [point.read() for point in model.scaling_points],
        "iterations": int(optimizer.iterations.numpy()),
        "dynamic_scale": float(optimizer.dynamic_scale.numpy()),
        "per_step": per_step,
    }


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("fit", "loop"))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument(
        "--workers",
        default="",
        help="comma-separated host:port of every worker: train with "
        "MultiWorkerMirroredStrategy as worker --index (one CPU each)",
    )
    parser.add_argument("--index", type=int, default=0)
    args = parser.parse_args(argv)
    if args.workers:
        # The cluster must be known, and the strategy made, before
        # TensorFlow runs anything.
        os.environ["TF_CONFIG"] = json.dumps(
            {
                "cluster": {"worker": args.workers.split(",")},
                "task": {"type": "worker", "index": args.index},
            }
        )
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        devices = list(strategy.extended.worker_devices)
    else:
        devices = _configure_devices(args.replicas)
        import tensorflow as tf

        strategy = tf.distribute.MirroredStrategy(devices)

    import keras

    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    initial_weights = build().get_weights()
    train = {"fit": train_fit, "loop": train_loop}[args.mode]

    single = summary(*train(tf.distribute.get_strategy(), initial_weights))
    _count_collectives()
    mirrored = summary(*train(strategy, initial_weights))
    mirrored["collectives"] = COLLECTIVES
    result = {
        "devices": devices,
        "initial_weights": [w.tolist() for w in initial_weights],
        "replicas": strategy.num_replicas_in_sync,
        "single": single,
        "mirrored": mirrored,
    }
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.workers:
        # Every collective is done; skip the multi-worker runtime's
        # shutdown, which can wait on the other worker.
        os._exit(0)


if __name__ == "__main__":
    main()
