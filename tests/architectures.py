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
import tensorflow as tf

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


def post_ln_transformer(blocks=2, dim=64, heads=4, length=32, vocabulary=200):
    """A post-LN Transformer encoder (LayerNormalization after each residual
    add, as in the original Transformer and BERT): gradients grow on the
    way back through every LayerNormalization."""
    tokens = keras.Input((length,), dtype="int32")
    x = layers.Embedding(vocabulary, dim)(tokens)
    for _ in range(blocks):
        attention = layers.MultiHeadAttention(heads, dim // heads)(x, x)
        x = layers.LayerNormalization()(layers.Add()([x, attention]))
        y = layers.Dense(4 * dim, activation="gelu")(x)
        y = layers.Dense(dim)(y)
        x = layers.LayerNormalization()(layers.Add()([x, y]))
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(8, dtype="float32")(x)
    return keras.Model(tokens, outputs, name="post_ln_transformer")


def post_ln_tokens(batches, batch=32, length=32, vocabulary=200, classes=8, seed=0):
    """`batches` batches of token ids whose label is a function of the
    first four tokens (learnable, so the loss and gradients keep moving)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocabulary, size=(batches * batch, length)).astype("int32")
    return x, x[:, :4].sum(axis=1) % classes


# -- where weight-gradient sums overflow (issue 39) ----------------------


def unet(size=64, levels=4, width=8):
    """A U-Net for binary segmentation: `levels` levels of two 3x3
    convolutions (ReLU) with max-pooling down and transposed convolutions
    up, skip connections by concatenation, a float32 sigmoid output."""
    inputs = keras.Input((size, size, 3))
    x, skips = inputs, []
    for level in range(levels):
        filters = width * 2**level
        x = layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        skips.append(x)
        x = layers.MaxPooling2D()(x)
    x = layers.Conv2D(width * 2**levels, 3, padding="same", activation="relu")(x)
    for level in reversed(range(levels)):
        filters = width * 2**level
        x = layers.Conv2DTranspose(filters, 2, strides=2)(x)
        x = layers.Concatenate()([x, skips[level]])
        x = layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
    outputs = layers.Conv2D(1, 1, activation="sigmoid", dtype="float32")(x)
    return keras.Model(inputs, outputs)


ANCHORS = 4  # per position of a detector's head
CLASSES = 5  # a detector's, background included


def anchor_count(size):
    """The anchors of a `detector` of `size` px inputs."""
    return ANCHORS * sum((size // 2**level) ** 2 for level in (3, 4, 5))


def detector(size, width=16):
    """SSD-style: strided 3x3 stages down to size/32, a 3x3 head of box
    offsets and class logits on each of the maps at /8, /16 and /32,
    concatenated over anchors; float32 output."""
    inputs = keras.Input((size, size, 3))
    x, heads = inputs, []
    for stage in range(5):
        filters = min(width * 2**stage, 128)
        x = layers.Conv2D(filters, 3, strides=2, padding="same", activation="relu")(x)
        x = layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        if stage >= 2:
            boxes = layers.Conv2D(ANCHORS * 4, 3, padding="same")(x)
            logits = layers.Conv2D(ANCHORS * CLASSES, 3, padding="same")(x)
            heads.append(layers.Concatenate()([
                layers.Reshape((-1, 4))(boxes), layers.Reshape((-1, CLASSES))(logits)
            ]))
    outputs = layers.Concatenate(axis=1, dtype="float32")(heads)
    return keras.Model(inputs, outputs)


def detection_loss(normalise):
    """A focal classification loss (gamma 2) over every anchor plus a Huber
    loss of the box offsets over the matched ones; both summed per image
    and, with `normalise`, divided by the image's matched anchors."""

    def loss(y_true, y_pred):
        labels = tf.cast(y_true[..., 0], tf.int32)
        matched = tf.cast(labels > 0, tf.float32)
        probabilities = tf.nn.softmax(y_pred[..., 4:])
        p = tf.reduce_sum(probabilities * tf.one_hot(labels, CLASSES), axis=-1)
        focal = -tf.square(1.0 - p) * tf.math.log(tf.maximum(p, 1e-7))
        error = tf.abs(y_pred[..., :4] - y_true[..., 1:])
        huber = tf.reduce_sum(tf.where(error < 1.0, 0.5 * error**2, error - 0.5), axis=-1)
        total = tf.reduce_sum(focal + matched * huber, axis=-1)
        if normalise:
            total = total / tf.maximum(tf.reduce_sum(matched, axis=-1), 1.0)
        return total

    return loss


def conv3d(size, width=8):
    """Two levels of 3x3x3 convolutions, a strided one down and a
    transposed one up, a skip connection, a float32 sigmoid."""
    inputs = keras.Input((size, size, size, 1))
    x = layers.Conv3D(width, 3, padding="same", activation="relu")(inputs)
    skip = layers.Conv3D(width, 3, padding="same", activation="relu")(x)
    # Down by a strided convolution, as V-Net does (TensorFlow has no
    # float16 MaxPool3D on the CPU).
    x = layers.Conv3D(2 * width, 2, strides=2, activation="relu")(skip)
    x = layers.Conv3D(2 * width, 3, padding="same", activation="relu")(x)
    x = layers.Conv3DTranspose(width, 2, strides=2)(x)
    x = layers.Concatenate()([x, skip])
    x = layers.Conv3D(width, 3, padding="same", activation="relu")(x)
    outputs = layers.Conv3D(1, 1, activation="sigmoid", dtype="float32")(x)
    return keras.Model(inputs, outputs)


def pixel_loss(reduction):
    """Binary cross-entropy per pixel, averaged or summed over each
    example's pixels."""

    def loss(y_true, y_pred):
        per_pixel = keras.losses.binary_crossentropy(y_true, y_pred)
        axes = list(range(1, len(per_pixel.shape)))
        if reduction == "sum":
            return tf.reduce_sum(per_pixel, axis=axes)
        return tf.reduce_mean(per_pixel, axis=axes)

    return loss


def _masks(rng, shape):
    """Gaussian inputs of `shape` (channels last) and the sign of their
    channel sum smoothed over the spatial axes, as a float mask."""
    x = rng.normal(size=shape).astype("float32")
    box = np.ones(9) / 9
    smooth = x.sum(-1)
    for axis in range(1, smooth.ndim):
        smooth = np.apply_along_axis(lambda r: np.convolve(r, box, "same"), axis, smooth)
    return x, (smooth > 0).astype("float32")[..., None]


def overflow_data(model, size, count, seed=0):
    """(x, y): `count` Gaussian examples for `model` ("unet", "detector"
    or "conv3d") of `size` px. The segmenters' masks are learnable from
    the inputs (`_masks`); the detector's anchors are matched at random
    (3%, a random class and box offsets each)."""
    rng = np.random.default_rng(seed)
    if model == "unet":
        return _masks(rng, (count, size, size, 3))
    if model == "conv3d":
        return _masks(rng, (count, size, size, size, 1))
    x = rng.normal(size=(count, size, size, 3)).astype("float32")
    anchors = anchor_count(size)
    labels = np.where(rng.random((count, anchors)) < 0.03, rng.integers(1, CLASSES, (count, anchors)), 0)
    offsets = rng.normal(0.0, 1.0, (count, anchors, 4)) * (labels > 0)[..., None]
    # One target array: the class id, then the four box offsets.
    return x, np.concatenate([labels[..., None], offsets], axis=-1).astype("float32")


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


@keras.saving.register_keras_serializable(package="tf_als_tests")
class ResidualBlock(layers.Layer):
    """A custom composite layer: sublayers with weights, raw TensorFlow ops
    and a residual fork inside its own `call`."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.norm = layers.LayerNormalization()
        self.inner = layers.Dense(units * 2, activation="relu")
        self.outer = layers.Dense(units)

    def call(self, x):
        import tensorflow as tf

        y = self.outer(self.inner(self.norm(x)))
        return tf.add(x, y)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="tf_als_tests")
class Encoder(keras.Model):
    """A subclassed model, used as a layer inside a Functional model."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.first = ResidualBlock(units)
        self.second = ResidualBlock(units)
        self.attention = layers.MultiHeadAttention(num_heads=2, key_dim=8)

    def call(self, x, training=None):
        x = self.first(x)
        x = x + self.attention(x, x, training=training)
        return self.second(x)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="tf_als_tests")
class Classifier(keras.Model):
    """A subclassed model at the top: a projection, an `Encoder`, pooling,
    a float32 head, and a weight of its own (a learned temperature)."""

    def __init__(self, units, classes, **kwargs):
        super().__init__(**kwargs)
        self.units, self.classes = units, classes
        self.project = layers.Dense(units)
        self.encoder = Encoder(units)
        self.pool = layers.GlobalAveragePooling1D()
        self.head = layers.Dense(classes, dtype="float32")
        self.temperature = self.add_weight(
            shape=(), initializer="ones", name="temperature"
        )

    def call(self, x, training=None):
        x = self.encoder(self.project(x), training=training)
        return self.head(self.pool(x)) * self.temperature

    def get_config(self):
        return {**super().get_config(), "units": self.units, "classes": self.classes}


def subclassed():
    model = Classifier(16, 4, name="classifier")
    model(np.zeros((1, 6, 16), "float32"))
    return model


def composite_layers():
    """A custom composite layer and a subclassed model used as a layer."""
    inputs = keras.Input((6, 16))
    x = ResidualBlock(16, name="block")(inputs)
    x = Encoder(16, name="encoder")(x)
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(4, dtype="float32")(x)
    return keras.Model(inputs, outputs, name="composite_layers")


def _token_vectors(batch=8, length=6, features=16, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, length, features)).astype("float32")
    return x, rng.integers(0, classes, size=(batch,))


# KerasHub backbones built from constructor arguments (tiny, random weights,
# dropout 0; nothing downloads), each with a task head. Their transformer
# blocks are composite layers: tf_als opens them, so every projection and
# normalisation inside is a scaling point.
_HUB_TEXT = dict(vocabulary_size=50, num_layers=2, hidden_dim=16, intermediate_dim=32)


def gpt2_backbone():
    import keras_hub

    return keras_hub.models.GPT2Backbone(
        num_heads=2, max_sequence_length=8, dropout=0.0, **_HUB_TEXT
    )


def llama_backbone():
    import keras_hub

    return keras_hub.models.LlamaBackbone(
        num_query_heads=2, num_key_value_heads=1, dropout=0.0, **_HUB_TEXT
    )


def gemma_backbone():
    import keras_hub

    return keras_hub.models.GemmaBackbone(
        num_query_heads=2, num_key_value_heads=1, head_dim=8, dropout=0.0,
        **_HUB_TEXT,
    )


def bert_backbone():
    import keras_hub

    return keras_hub.models.BertBackbone(
        num_heads=2, max_sequence_length=8, dropout=0.0, **_HUB_TEXT
    )


def vit_backbone():
    import keras_hub

    return keras_hub.models.ViTBackbone(
        image_shape=(16, 16, 3), patch_size=4, num_layers=2, num_heads=2,
        hidden_dim=16, mlp_dim=32, dropout_rate=0.0, attention_dropout=0.0,
    )


def resnet_backbone():
    import keras_hub

    return keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 32], stackwise_num_blocks=[1, 1],
        stackwise_num_strides=[1, 2], block_type="basic_block",
        image_shape=(16, 16, 3),
    )


def causal_lm(backbone_fn):
    """A language-model head as KerasHub's CausalLM tasks build it: the
    token embedding called again in reverse (tied or not), float32 logits."""

    def build():
        backbone = backbone_fn()
        inputs = {
            "token_ids": keras.Input((8,), dtype="int32", name="token_ids"),
            "padding_mask": keras.Input((8,), dtype="int32", name="padding_mask"),
        }
        x = backbone(inputs)
        logits = backbone.token_embedding(x, reverse=True)
        outputs = layers.Activation("linear", dtype="float32")(logits)
        return keras.Model(inputs, outputs, name=f"{backbone.name}_lm")

    return build


def classifier(backbone_fn, pick):
    """A float32 classification head on `pick(backbone outputs)`."""

    def build():
        backbone = backbone_fn()
        inputs = backbone.input
        x = pick(backbone(inputs))
        if len(x.shape) > 2:
            x = layers.GlobalAveragePooling1D()(x) if len(x.shape) == 3 else (
                layers.GlobalAveragePooling2D()(x)
            )
        outputs = layers.Dense(4, dtype="float32")(x)
        return keras.Model(inputs, outputs, name=f"{backbone.name}_classifier")

    return build


def _lm_tokens(batch=4, length=8, vocabulary=50, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocabulary, size=(batch, length + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((batch, length), "int32")}
    return x, tokens[:, 1:]


def _decoder_tokens(batch=4, length=8, vocabulary=50, seed=0):
    x, _ = _lm_tokens(batch, length, vocabulary, seed)
    return x, np.random.default_rng(seed).integers(0, 4, size=(batch,))


def _bert_tokens(batch=4, length=8, vocabulary=50, seed=0):
    rng = np.random.default_rng(seed)
    x = {
        "token_ids": rng.integers(1, vocabulary, size=(batch, length)).astype("int32"),
        "segment_ids": np.zeros((batch, length), "int32"),
        "padding_mask": np.ones((batch, length), "int32"),
    }
    return x, rng.integers(0, 4, size=(batch,))


HUB_CASES = (
    Case("gpt2", causal_lm(gpt2_backbone), _lm_tokens, _classification_loss()),
    Case("llama", causal_lm(llama_backbone), _lm_tokens, _classification_loss()),
    Case(
        "gemma", causal_lm(gemma_backbone), _lm_tokens, _classification_loss(),
        slow=True,
    ),
    Case(
        "bert",
        classifier(bert_backbone, lambda out: out["pooled_output"]),
        _bert_tokens,
        _classification_loss(),
    ),
    Case(
        "vit",
        classifier(vit_backbone, lambda out: out[:, 0]),
        lambda: _images(batch=4, size=16, classes=4),
        _classification_loss(),
    ),
    Case(
        "resnet_backbone",
        classifier(resnet_backbone, lambda out: out),
        lambda: _images(batch=4, size=16, classes=4),
        _classification_loss(),
        slow=True,
    ),
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
    Case("composite_layers", composite_layers, _token_vectors, _classification_loss()),
    Case("subclassed", subclassed, _token_vectors, _classification_loss()),
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

ALL_CASES = CASES + HUB_CASES
COMPOSITE_NAMES_CASE = HUB_CASES[0]
# The causal-LM heads call the backbone's embedding from outside the
# backbone, which Keras's `.keras` format does not reload (with or without
# tf_als: "expected 1 variables, but received 0"); saving uses
# classification heads on the same decoders.
SAVE_CASES = tuple(c for c in ALL_CASES if c.name in (
    "transformer", "composite_layers", "subclassed", "bert", "vit", "resnet_backbone"
)) + (
    Case(
        "gpt2_classifier",
        classifier(gpt2_backbone, lambda out: out),
        _decoder_tokens,
        _classification_loss(),
    ),
    Case(
        "llama_classifier",
        classifier(llama_backbone, lambda out: out),
        _decoder_tokens,
        _classification_loss(),
    ),
)
