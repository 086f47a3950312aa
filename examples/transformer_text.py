"""A small Transformer encoder text classifier trained in float16 with
per-layer loss scales.

The model: token Embedding plus a learned position embedding, one encoder
block (MultiHeadAttention and a feed-forward network, each with a residual
connection and LayerNormalization), average pooling over the sequence and a
float32 head. The attention's query, key and value all read the same tensor,
and each residual adds a tensor to its own transformation: tf_als brings
those gradient contributions to a common per-layer scale before summing
them. The position embedding is a small custom layer that owns a weight, so
it is a scaling point of its own.

The data are synthetic token sequences (no download): random tokens with
one marker token inserted at a random position; the label says whether the
marker sits in the first half of the sequence, so the model needs both the
token and its position.

Run:

    python examples/transformer_text.py            # ~30 s on 2 CPU cores
    python examples/transformer_text.py --quick    # 3 epochs, for tests
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_als  # noqa: E402

layers = keras.layers

VOCABULARY = 64
LENGTH = 16
MARKER = 1  # token 0 is unused, 1 the marker, 2.. ordinary tokens
CLASSES = 2


def make_sequences(samples: int, seed: int = 0):
    """`(x, y)`: int32 token ids `(samples, LENGTH)` with exactly one
    `MARKER` each, and int64 labels: 1 when the marker is in the first half
    of the sequence."""
    rng = np.random.default_rng(seed)
    x = rng.integers(2, VOCABULARY, size=(samples, LENGTH))
    where = rng.integers(0, LENGTH, size=samples)
    x[np.arange(samples), where] = MARKER
    y = (where < LENGTH // 2).astype("int64")
    return x.astype("int32"), y


class PositionEmbedding(layers.Layer):
    """Adds a learned vector per position to `(batch, length, dim)` inputs."""

    def build(self, input_shape):
        self.positions = self.add_weight(
            shape=tuple(input_shape[1:]),
            initializer=keras.initializers.RandomNormal(stddev=0.05),
            name="positions",
        )

    def call(self, x):
        return x + keras.ops.cast(self.positions, x.dtype)


def encoder_block(x, heads: int, key_dim: int, hidden: int):
    """Post-norm Transformer encoder block: attention and feed-forward
    sublayers, each `LayerNorm(x + sublayer(x))`."""
    width = x.shape[-1]
    attended = layers.MultiHeadAttention(heads, key_dim, name="attention")(x, x)
    x = layers.Add(name="attention_residual")([x, attended])
    x = layers.LayerNormalization(name="attention_norm")(x)
    y = layers.Dense(hidden, activation="relu", name="ffn_in")(x)
    y = layers.Dense(width, name="ffn_out")(y)
    x = layers.Add(name="ffn_residual")([x, y])
    return layers.LayerNormalization(name="ffn_norm")(x)


def build_model(width: int = 32, heads: int = 2, hidden: int = 64) -> keras.Model:
    tokens = keras.Input((LENGTH,), dtype="int32", name="tokens")
    x = layers.Embedding(VOCABULARY, width, name="token_embedding")(tokens)
    x = PositionEmbedding(name="position_embedding")(x)
    x = encoder_block(x, heads, width // heads, hidden)
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = layers.Dense(CLASSES, dtype="float32", name="logits")(x)
    return keras.Model(tokens, outputs, name="tiny_transformer")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8, help="default 8")
    parser.add_argument("--samples", type=int, default=2048,
                        help="training sequences (default 2048)")
    parser.add_argument("--batch-size", type=int, default=64, help="default 64")
    parser.add_argument("--learning-rate", type=float, default=2e-3,
                        help="Adam learning rate (default 2e-3)")
    parser.add_argument("--telemetry-interval", type=int, default=10,
                        help="steps between per-layer scale updates (default 10)")
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
    for name in ("epochs", "samples", "batch_size", "telemetry_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(args.seed)
    x_train, y_train = make_sequences(args.samples, seed=args.seed)
    x_test, y_test = make_sequences(512, seed=args.seed + 1)

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
        print(f"  {name:20s} {scale:8g}")
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
