"""Small models of every architecture family tf_als must handle, with data.

Each builder builds under the current global dtype policy, so calling it
once under "float32" and once under "mixed_float16" gives the same
architecture in both precisions; `Case.build_pair` copies the float32
weights into the mixed one. Heads and outputs are float32, as Keras's mixed
precision guide recommends. Nothing here is random at training time (no
dropout), so float32 and float16 runs see the same function.
"""

import dataclasses
from typing import Callable

import keras
import numpy as np

layers = keras.layers


@dataclasses.dataclass(frozen=True)
class Case:
    """A model builder and a batch for it.

    Attributes:
        name: test id.
        build: builds the (uncompiled) model under the current policy.
        data: returns `(x, y)` for one batch (numpy, deterministic).
        loss: `(y_true, y_pred) -> scalar`, a Keras loss.
        slow: heavier models, marked `slow` in the tests.
        training: the `training` argument of the forward pass. The deep
            `keras.applications` models run BatchNormalization in inference
            mode: with batch statistics of a few images their float16
            forward pass already differs from float32 by 2-18% at the logits
            (measured), which no backward pass can repair, so only inference
            mode lets the gradients measure backward-pass precision.
    """

    name: str
    build: Callable
    data: Callable
    loss: Callable
    slow: bool = False
    training: bool = True

    def build_pair(self, seed=0):
        """Returns `(float32 model, mixed_float16 model)` with equal weights."""
        keras.mixed_precision.set_global_policy("float32")
        keras.utils.set_random_seed(seed)
        reference = self.build()
        keras.mixed_precision.set_global_policy("mixed_float16")
        keras.utils.set_random_seed(seed)
        mixed = self.build()
        mixed.set_weights(reference.get_weights())
        return reference, mixed


def _classification_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _images(batch=16, size=16, channels=3, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, size, size, channels)).astype("float32")
    y = rng.integers(0, classes, size=(batch,))
    return x, y


def _vectors(batch=32, features=32, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, features)).astype("float32")
    y = rng.integers(0, classes, size=(batch,))
    return x, y


def deep_mlp():
    inputs = keras.Input((32,))
    x = inputs
    for _ in range(8):
        x = layers.Dense(64, activation="relu")(x)
    outputs = layers.Dense(10, dtype="float32")(x)
    return keras.Model(inputs, outputs, name="deep_mlp")


def cnn_batchnorm():
    inputs = keras.Input((16, 16, 3))
    x = inputs
    for filters in (16, 32, 32):
        x = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        x = layers.ReLU()(x)
        x = layers.MaxPooling2D()(x)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(10, dtype="float32")(x)
    return keras.Model(inputs, outputs, name="cnn_batchnorm")


def resnet():
    """Residual network: identity and projection shortcuts (Add forks)."""
    inputs = keras.Input((16, 16, 3))
    x = layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = layers.BatchNormalization()(x)
    x = layers.ReLU()(x)
    for filters, stride in ((16, 1), (16, 1), (32, 2), (32, 1)):
        shortcut = x
        y = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
        y = layers.BatchNormalization()(y)
        y = layers.ReLU()(y)
        y = layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
        y = layers.BatchNormalization()(y)
        if stride != 1 or shortcut.shape[-1] != filters:
            shortcut = layers.Conv2D(filters, 1, strides=stride, use_bias=False)(x)
            shortcut = layers.BatchNormalization()(shortcut)
        x = layers.ReLU()(layers.Add()([shortcut, y]))
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(10, dtype="float32")(x)
    return keras.Model(inputs, outputs, name="resnet")


def transformer():
    """One Transformer encoder block on token ids: Embedding (sparse
    gradients), self-attention (Q/K/V fork), LayerNormalization, residuals."""
    tokens = keras.Input((12,), dtype="int32")
    x = layers.Embedding(50, 32)(tokens)
    attention = layers.MultiHeadAttention(num_heads=2, key_dim=16)(x, x)
    x = layers.LayerNormalization()(layers.Add()([x, attention]))
    y = layers.Dense(64, activation="gelu")(x)
    y = layers.Dense(32)(y)
    x = layers.LayerNormalization()(layers.Add()([x, y]))
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(5, dtype="float32")(x)
    return keras.Model(tokens, outputs, name="transformer")


def _tokens(batch=16, length=12, vocabulary=50, classes=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocabulary, size=(batch, length)).astype("int32")
    y = rng.integers(0, classes, size=(batch,))
    return x, y


def integer_inputs():
    """Integer-only inputs straight into a Dense layer (Keras casts them to
    float16): no input gradient exists; the layers' weights still need
    scaled gradients. (Token ids into Embedding: `transformer`.)"""
    counts = keras.Input((16,), dtype="int32")
    x = layers.Dense(32, activation="relu")(counts)
    x = layers.Dense(32, activation="relu")(x)
    outputs = layers.Dense(10, dtype="float32")(x)
    return keras.Model(counts, outputs, name="integer_inputs")


def _counts(batch=32, features=16, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 4, size=(batch, features)).astype("int32")
    y = rng.integers(0, classes, size=(batch,))
    return x, y


def lstm():
    inputs = keras.Input((10, 8))
    x = layers.LSTM(24, return_sequences=True)(inputs)
    x = layers.LSTM(16)(x)
    outputs = layers.Dense(4, dtype="float32")(x)
    return keras.Model(inputs, outputs, name="lstm")


def _sequences(batch=16, length=10, features=8, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, length, features)).astype("float32")
    y = rng.integers(0, classes, size=(batch,))
    return x, y


def shared_layer():
    """One Dense layer called twice (shared weights, two scaling points)."""
    inputs = keras.Input((32,))
    shared = layers.Dense(32, activation="tanh", name="shared")
    x = layers.Dense(32, activation="relu")(inputs)
    x = shared(x)
    x = shared(x)
    outputs = layers.Dense(10, dtype="float32")(x)
    return keras.Model(inputs, outputs, name="shared_layer")


def nested():
    """A Functional model holding a nested Sequential and a nested
    Functional model."""
    encoder = keras.Sequential(
        [
            keras.Input((32,)),
            layers.Dense(48, activation="relu"),
            layers.Dense(32, activation="relu"),
        ],
        name="encoder",
    )
    head_inputs = keras.Input((32,))
    head_hidden = layers.Dense(32, activation="relu")(head_inputs)
    head = keras.Model(
        head_inputs, layers.Add()([head_inputs, head_hidden]), name="head"
    )
    inputs = keras.Input((32,))
    x = head(encoder(inputs))
    outputs = layers.Dense(10, dtype="float32")(x)
    return keras.Model(inputs, outputs, name="nested")


def two_in_two_out():
    image = keras.Input((16, 16, 3), name="image")
    features = keras.Input((8,), name="features")
    x = layers.Conv2D(8, 3, padding="same", activation="relu")(image)
    x = layers.GlobalAveragePooling2D()(x)
    f = layers.Dense(16, activation="relu")(features)
    joint = layers.Concatenate()([x, f])
    joint = layers.Dense(32, activation="relu")(joint)
    label = layers.Dense(10, dtype="float32", name="label")(joint)
    value = layers.Dense(1, dtype="float32", name="value")(joint)
    return keras.Model([image, features], [label, value], name="two_in_two_out")


def _two_in_two_out_data(seed=0):
    rng = np.random.default_rng(seed)
    image = rng.normal(size=(16, 16, 16, 3)).astype("float32")
    features = rng.normal(size=(16, 8)).astype("float32")
    label = rng.integers(0, 10, size=(16,))
    value = rng.normal(size=(16, 1)).astype("float32")
    return [image, features], [label, value]


class _TwoHeadLoss:
    """Cross-entropy on the label head plus squared error on the value head."""

    def __call__(self, y_true, y_pred):
        label = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        return label(y_true[0], y_pred[0]) + keras.ops.mean(
            keras.ops.square(y_true[1] - y_pred[1])
        )


def resnet50():
    return keras.applications.ResNet50(
        input_shape=(32, 32, 3), weights=None, classes=10,
        classifier_activation=None,
    )


def densenet121():
    return keras.applications.DenseNet121(
        input_shape=(32, 32, 3), weights=None, classes=10,
        classifier_activation=None,
    )


CASES = (
    Case("deep_mlp", deep_mlp, _vectors, _classification_loss()),
    Case("cnn_batchnorm", cnn_batchnorm, _images, _classification_loss()),
    Case("resnet", resnet, _images, _classification_loss()),
    Case("transformer", transformer, _tokens, _classification_loss()),
    Case("lstm", lstm, _sequences, _classification_loss()),
    Case("shared_layer", shared_layer, _vectors, _classification_loss()),
    Case("nested", nested, _vectors, _classification_loss()),
    Case("two_in_two_out", two_in_two_out, _two_in_two_out_data, _TwoHeadLoss()),
    Case("integer_inputs", integer_inputs, _counts, _classification_loss()),
    Case(
        "resnet50",
        resnet50,
        lambda: _images(batch=4, size=32),
        _classification_loss(),
        slow=True,
        training=False,
    ),
    Case(
        "densenet121",
        densenet121,
        lambda: _images(batch=4, size=32),
        _classification_loss(),
        slow=True,
        training=False,
    ),
)
