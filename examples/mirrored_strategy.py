"""Per-layer loss scales under `tf.distribute.MirroredStrategy`, on one CPU.

The CPU is split into two logical devices, so that a laptop without GPUs can
run two synchronised replicas. The model is built, instrumented and compiled
inside `MirroredStrategy(["/cpu:0", "/cpu:1"]).scope()` and trained with
`fit` on scikit-learn's digits (shipped with scikit-learn, nothing is
downloaded); each step splits the global batch between the replicas. tf_als
reduces each scaling point's gradient statistics across replicas, so both
replicas pick the same per-layer scales.

Logical devices can only be configured before TensorFlow initialises its
devices (the first op or variable, or listing logical devices, does that;
importing TensorFlow, Keras or tf_als does not), so run this as its own
process:

    python examples/mirrored_strategy.py           # ~40 s on 2 CPU cores
    python examples/mirrored_strategy.py --quick   # 2 epochs, for tests
    python examples/mirrored_strategy.py --json results.json   # also save the results
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import sklearn.datasets  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_als  # noqa: E402

REPLICAS = 2
CLASSES = 10


def split_cpu(count: int = REPLICAS) -> list:
    """Makes `count` logical CPU devices and returns their names.

    Must run before TensorFlow initialises its devices. If they are already
    initialised, the existing configuration is used when it has enough
    logical CPUs; otherwise a RuntimeError says to use a fresh process.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
        )
    except RuntimeError:
        pass  # already initialised; checked below
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(devices) < count:
        raise RuntimeError(
            f"Need {count} logical CPU devices but TensorFlow was initialised "
            f"with {len(devices)} ({devices}) before this example could split "
            "the CPU. Run it as its own process: "
            "`python examples/mirrored_strategy.py`."
        )
    return devices[:count]


def load_digits(seed: int = 0):
    """Digits as float32 8x8x1 images in [0, 1]:
    `(x_train, y_train, x_test, y_test)`, 80/20, shuffled by `seed`. scikit-learn ships the data: nothing is
    downloaded."""
    digits = sklearn.datasets.load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], digits.target[order].astype("int64")
    split = int(round(len(x) * 0.8))
    return x[:split], y[:split], x[split:], y[split:]


def build_model(input_shape=(8, 8, 1)) -> keras.Model:
    """Two conv-BN-ReLU layers, global average pooling and a float32 head."""
    layers = keras.layers
    inputs = keras.Input(input_shape, name="image")
    x = inputs
    for i, filters in enumerate((16, 32), start=1):
        x = layers.Conv2D(filters, 3, padding="same", use_bias=False,
                          name=f"conv_{i}")(x)
        x = layers.BatchNormalization(momentum=0.9, name=f"bn_{i}")(x)
        x = layers.ReLU(name=f"relu_{i}")(x)
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = layers.Dense(CLASSES, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name="digits_cnn")


def replica_values(row) -> list:
    """The value each replica holds of a scaling point's state (its
    variables are synchronised on read)."""
    return [np.asarray(v).item() for v in row.replica_values()]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=4, help="default 4")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="global batch size, split between replicas (default 64)")
    parser.add_argument("--learning-rate", type=float, default=1e-2,
                        help="Adam learning rate (default 1e-2)")
    parser.add_argument("--telemetry-interval", type=int, default=10,
                        help="steps between per-layer scale updates (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="default 0")
    parser.add_argument("--quick", action="store_true",
                        help="2 epochs, for tests")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write the results dict to PATH as JSON")
    parser.add_argument("--verbose", type=int, choices=(0, 1, 2), default=2,
                        help="Keras fit verbosity (default 2: a line per epoch)")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs = 2
    for name in ("epochs", "batch_size", "telemetry_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.batch_size % REPLICAS:
        parser.error(f"--batch-size must be a multiple of {REPLICAS}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    devices = split_cpu(REPLICAS)  # first: before TensorFlow sets up devices
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(args.seed)
    x_train, y_train, x_test, y_test = load_digits(seed=args.seed)

    strategy = tf.distribute.MirroredStrategy(devices)
    print(f"Replicas in sync: {strategy.num_replicas_in_sync} on {devices}")
    with strategy.scope():
        model = tf_als.instrument(build_model(x_train.shape[1:]))
        model.compile(
            optimizer=tf_als.AdaptiveLossScaleOptimizer(
                keras.optimizers.Adam(args.learning_rate),
                telemetry_interval=args.telemetry_interval,
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = tf_als.callbacks.ScaleHistory()
    fit = model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        callbacks=[history],
        verbose=args.verbose,
    )
    test_loss, test_accuracy = model.evaluate(x_test, y_test, verbose=0)

    scales = tf_als.scales(model)
    # Every replica holds its own copy of each scaling point's state; they
    # must agree, since all replicas apply the same per-layer scales.
    per_replica = {
        point.point_name: replica_values(point.scale)
        for point in model.scaling_points
    }
    last_update = {
        point.point_name: replica_values(point.last_update)
        for point in model.scaling_points
    }
    print("\nPer-layer loss scales (as each replica holds them):")
    for name, values in per_replica.items():
        print(f"  {name:8s} {' '.join(f'{v:6g}' for v in values)}")
    print(f"Scale updates at steps {history.history['step']}")
    print(f"Test accuracy: {test_accuracy:.3f} (chance {1 / CLASSES:.2f})")
    results = {
        "replicas": int(strategy.num_replicas_in_sync),
        "losses": [float(v) for v in fit.history["loss"]],
        "test_loss": float(test_loss),
        "test_accuracy": float(test_accuracy),
        "scales": scales,
        "replica_scales": per_replica,
        "replica_last_update": last_update,
        "loss_scale": float(fit.history["loss_scale"][-1]),
        "skipped_steps": int(fit.history["skipped_steps"][-1]),
        "steps": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        "scale_updates": list(history.history["step"]),
    }
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return results


if __name__ == "__main__":
    main()
