"""A small ResNet-style CNN trained in float16 with per-layer loss scales.

The model is a Functional network of residual blocks (Conv2D +
BatchNormalization + ReLU, twice, added to a shortcut; a strided block with
a 1x1 projection shortcut), global average pooling and a float32 head. Every
Conv2D, BatchNormalization and Dense call is a scaling point; where a tensor
feeds both a block and its shortcut, tf_als brings the two gradient
contributions to a common scale before they are summed.

The data are synthetic 16x16x3 images, generated on the fly (no download):
each class has a fixed random pattern, and every image is its class's
pattern, randomly shifted, plus Gaussian noise, so accuracy climbs well above
chance within a few epochs.

Run:

    python examples/resnet_cnn.py              # ~30 s on 2 CPU cores
    python examples/resnet_cnn.py --quick      # 512 images, 3 epochs, for tests
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_als  # noqa: E402

layers = keras.layers

CLASSES = 4
IMAGE_SHAPE = (16, 16, 3)


def make_images(samples: int, noise: float = 1.0, seed: int = 0):
    """`(x, y)`: float32 images `(samples, 16, 16, 3)`, int64 labels in
    `[0, CLASSES)`. The class patterns are fixed (seed 1234) so that every
    call draws from the same task; `seed` draws the samples."""
    patterns = np.random.default_rng(1234).normal(size=(CLASSES,) + IMAGE_SHAPE)
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, size=samples)
    shifts = rng.integers(-2, 3, size=(samples, 2))
    x = np.stack(
        [np.roll(patterns[label], tuple(shift), axis=(0, 1))
         for label, shift in zip(y, shifts)]
    )
    x = x + noise * rng.normal(size=x.shape)
    return x.astype("float32"), y.astype("int64")


def conv_bn(x, filters: int, name: str, strides: int = 1, kernel: int = 3,
            relu: bool = True):
    x = layers.Conv2D(filters, kernel, strides=strides, padding="same",
                      use_bias=False, name=f"{name}_conv")(x)
    # momentum 0.9: the moving statistics used at test time settle within
    # the few dozen steps of a short run.
    x = layers.BatchNormalization(momentum=0.9, name=f"{name}_bn")(x)
    return layers.ReLU(name=f"{name}_relu")(x) if relu else x


def residual_block(x, filters: int, name: str, strides: int = 1):
    """Two 3x3 conv-BN layers plus a shortcut (a strided 1x1 conv-BN when the
    shape changes), then ReLU."""
    shortcut = x
    if strides != 1 or x.shape[-1] != filters:
        shortcut = conv_bn(x, filters, f"{name}_proj", strides=strides,
                           kernel=1, relu=False)
    y = conv_bn(x, filters, f"{name}_a", strides=strides)
    y = conv_bn(y, filters, f"{name}_b", relu=False)
    y = layers.Add(name=f"{name}_add")([shortcut, y])
    return layers.ReLU(name=f"{name}_out")(y)


def build_model(input_shape=IMAGE_SHAPE, classes: int = CLASSES) -> keras.Model:
    inputs = keras.Input(input_shape, name="image")
    x = conv_bn(inputs, 16, "stem")
    x = residual_block(x, 16, "block1")
    x = residual_block(x, 32, "block2", strides=2)
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = layers.Dense(classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name="small_resnet")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=4, help="default 4")
    parser.add_argument("--samples", type=int, default=768,
                        help="training images (default 768)")
    parser.add_argument("--batch-size", type=int, default=64, help="default 64")
    parser.add_argument("--learning-rate", type=float, default=3e-3,
                        help="Adam learning rate (default 3e-3)")
    parser.add_argument("--telemetry-interval", type=int, default=10,
                        help="steps between per-layer scale updates (default 10)")
    parser.add_argument("--log-dir", default=None,
                        help="write ScaleHistory TensorBoard summaries here")
    parser.add_argument("--seed", type=int, default=0, help="default 0")
    parser.add_argument("--quick", action="store_true",
                        help="512 images, 3 epochs, for tests")
    parser.add_argument("--verbose", type=int, choices=(0, 1, 2), default=2,
                        help="Keras fit verbosity (default 2: a line per epoch)")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.samples = 3, 512
    for name in ("epochs", "samples", "batch_size", "telemetry_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(args.seed)
    x_train, y_train = make_images(args.samples, seed=args.seed)
    x_test, y_test = make_images(512, seed=args.seed + 1)

    model = tf_als.instrument(build_model())
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
    print(f"\n{len(scales)} scaling points; per-layer loss scales:")
    for name, scale in scales.items():
        print(f"  {name:16s} {scale:8g}")
    print(f"Test accuracy: {test_accuracy:.3f} (chance {1 / CLASSES:.2f})")
    return {
        "losses": [float(v) for v in fit.history["loss"]],
        "accuracies": [float(v) for v in fit.history["accuracy"]],
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
