"""Quick start: float16 training with per-layer loss scales, using `fit`.

Trains a small MLP on scikit-learn's digits (8x8 images, shipped with
scikit-learn, nothing is downloaded) under the `mixed_float16` policy. The
model is wrapped with `tf_als.instrument`, compiled with
`tf_als.AdaptiveLossScaleOptimizer`, trained with `fit` while
`tf_als.callbacks.ScaleHistory` records every per-layer scale update, and
the final per-layer scales are printed with `tf_als.scales`.

Run:

    python examples/quickstart_fit.py                  # ~20 s on 2 CPU cores
    python examples/quickstart_fit.py --log-dir logs   # + TensorBoard summaries
    python examples/quickstart_fit.py --quick          # 3 epochs, for tests
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import sklearn.datasets  # noqa: E402

import tf_als  # noqa: E402

CLASSES = 10


def load_digits(seed: int = 0):
    """Digits as flat float32 vectors in [0, 1]:
    `(x_train, y_train, x_test, y_test)`, 80/20, shuffled by `seed`. scikit-learn ships the data: nothing is
    downloaded."""
    digits = sklearn.datasets.load_digits()
    x = (digits.images / 16.0).astype("float32").reshape(len(digits.images), -1)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], digits.target[order].astype("int64")
    split = int(round(len(x) * 0.8))
    return x[:split], y[:split], x[split:], y[split:]


def build_model(features: int = 64) -> keras.Model:
    """A three-layer MLP; the head stays float32, as Keras's mixed precision
    guide recommends."""
    inputs = keras.Input((features,), name="pixels")
    x = keras.layers.Dense(128, activation="relu", name="hidden_1")(inputs)
    x = keras.layers.Dense(64, activation="relu", name="hidden_2")(x)
    outputs = keras.layers.Dense(CLASSES, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name="digits_mlp")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10, help="default 10")
    parser.add_argument("--batch-size", type=int, default=64, help="default 64")
    parser.add_argument("--learning-rate", type=float, default=1e-3,
                        help="Adam learning rate (default 1e-3)")
    parser.add_argument("--telemetry-interval", type=int, default=20,
                        help="steps between per-layer scale updates (default 20)")
    parser.add_argument("--log-dir", default=None,
                        help="write ScaleHistory TensorBoard summaries here")
    parser.add_argument("--seed", type=int, default=0, help="default 0")
    parser.add_argument("--quick", action="store_true",
                        help="3 epochs, for tests")
    parser.add_argument("--verbose", type=int, choices=(0, 1, 2), default=2,
                        help="Keras fit verbosity (default 2: a line per epoch)")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs = 3
    for name in ("epochs", "batch_size", "telemetry_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(args.seed)
    x_train, y_train, x_test, y_test = load_digits(seed=args.seed)

    model = tf_als.instrument(build_model(x_train.shape[1]))
    model.compile(
        optimizer=tf_als.AdaptiveLossScaleOptimizer(
            keras.optimizers.Adam(args.learning_rate),
            telemetry_interval=args.telemetry_interval,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = tf_als.callbacks.ScaleHistory(log_dir=args.log_dir)
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
    print("\nPer-layer loss scales:")
    for name, scale in scales.items():
        print(f"  {name:10s} {scale:8g}")
    print("(1: the global loss scale alone keeps the layer's gradients within "
          "float16's range; examples/resnet_cnn.py shows larger ones.)")
    print(f"Global loss scale: {fit.history['loss_scale'][-1]:g}, "
          f"scale updates recorded: {len(history.history['step'])}")
    print(f"Test accuracy: {test_accuracy:.3f} (chance {1 / CLASSES:.2f})")
    return {
        "losses": [float(v) for v in fit.history["loss"]],
        "test_loss": float(test_loss),
        "test_accuracy": float(test_accuracy),
        "scales": scales,
        "loss_scale": float(fit.history["loss_scale"][-1]),
        "skipped_steps": int(fit.history["skipped_steps"][-1]),
        "steps": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        "scale_updates": list(history.history["step"]),
    }


if __name__ == "__main__":
    main()
