"""Per-layer loss scales in a custom training loop (no `fit`).

Trains an MLP with `tanh` hidden layers on scikit-learn's digits (shipped
with scikit-learn, nothing is downloaded) under the `mixed_float16` policy,
with a hand-written training step compiled by `tf.function`:

    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
        scaled = optimizer.scale_loss(loss)      # times the global scale S
    grads = tape.gradient(scaled, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)

`optimizer.apply` receives gradients carrying the global loss scale, as with
Keras's own `LossScaleOptimizer`; the per-layer scales are removed inside
the backward pass. `ScaleHistory.record_step()` after each step records the
scale updates, as the callback does under `fit`, and
`optimizer.check_skips(batches=..., loss=...)` acts when
`max_consecutive_skips` steps in a row, or as many within twice that many,
were skipped (a compiled step cannot do it by itself; `fit` does this check
for you): it promotes a layer whose float16 forward or backward pass fails
to float32 and returns it (make the step again), or stops the loop with a
`tf_als.NonFiniteStormError`.

Run:

    python examples/custom_training_loop.py              # ~20 s on 2 CPU cores
    python examples/custom_training_loop.py --quick      # 3 epochs, for tests
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import sklearn.datasets  # noqa: E402
import tensorflow as tf  # noqa: E402

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


def build_model(features: int = 64, depth: int = 4) -> keras.Model:
    """`depth` tanh Dense layers and a float32 head."""
    inputs = keras.Input((features,), name="pixels")
    x = inputs
    for i in range(depth):
        x = keras.layers.Dense(64, activation="tanh", name=f"hidden_{i + 1}")(x)
    outputs = keras.layers.Dense(CLASSES, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name="digits_tanh_mlp")


def make_train_step(model, optimizer, loss_fn):
    """One optimizer step on a batch, compiled into a graph; returns the
    (unscaled) loss."""
    variables = model.trainable_variables
    # Create the optimizer's variables (slots, loss scale) up front: a
    # tf.function that creates variables on its first call is traced twice.
    optimizer.build(variables)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled_loss = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled_loss, variables)
        optimizer.apply(grads, variables)
        return loss

    return train_step


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10, help="default 10")
    parser.add_argument("--batch-size", type=int, default=64, help="default 64")
    parser.add_argument("--learning-rate", type=float, default=1e-3,
                        help="Adam learning rate (default 1e-3)")
    parser.add_argument("--telemetry-interval", type=int, default=10,
                        help="steps between per-layer scale updates (default 10)")
    parser.add_argument("--log-dir", default=None,
                        help="write ScaleHistory TensorBoard summaries here")
    parser.add_argument("--seed", type=int, default=0, help="default 0")
    parser.add_argument("--quick", action="store_true",
                        help="3 epochs, for tests")
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
    # Equal-sized batches: `train_step` is traced once (a smaller last batch
    # would trace it again for the new shape).
    batches = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(len(x_train), seed=args.seed)
        .batch(args.batch_size, drop_remainder=True)
    )

    model = tf_als.instrument(build_model(x_train.shape[1]))
    optimizer = tf_als.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(args.learning_rate),
        telemetry_interval=args.telemetry_interval,
    )
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    train_step = make_train_step(model, optimizer, loss_fn)
    history = tf_als.callbacks.ScaleHistory(log_dir=args.log_dir)
    history.set_model(model)

    epoch_losses = []
    for epoch in range(args.epochs):
        mean_loss = keras.metrics.Mean()
        for x, y in batches:
            mean_loss.update_state(train_step(x, y))
            history.record_step()
            # Stops a run whose steps are all skipped; or, when a layer's
            # float16 forward or backward pass failed, promotes it to
            # float32 and returns it: trace the step again so that it
            # computes in float32.
            if optimizer.check_skips(batches=lambda x=x, y=y: [(x, y)], loss=loss_fn):
                train_step = make_train_step(model, optimizer, loss_fn)
        epoch_losses.append(float(mean_loss.result()))
        print(f"epoch {epoch + 1}/{args.epochs}: loss {epoch_losses[-1]:.4f}, "
              f"global loss scale {float(optimizer.dynamic_scale):g}")

    logits = model(x_test, training=False)
    test_loss = float(loss_fn(y_test, logits))
    test_accuracy = float(np.mean(np.argmax(logits, axis=-1) == y_test))
    scales = tf_als.scales(model)
    print("\nPer-layer loss scales:")
    for name, scale in scales.items():
        print(f"  {name:10s} {scale:8g}")
    print(f"Scale updates at steps {history.history['step']}, "
          f"skipped steps: {history.skipped_steps}")
    print(f"Test accuracy: {test_accuracy:.3f} (chance {1 / CLASSES:.2f})")
    return {
        "losses": epoch_losses,
        "test_loss": test_loss,
        "test_accuracy": test_accuracy,
        "scales": scales,
        "loss_scale": float(optimizer.dynamic_scale),
        "skipped_steps": history.skipped_steps,
        "steps": int(optimizer.iterations),
        "scale_updates": list(history.history["step"]),
    }


if __name__ == "__main__":
    main()
