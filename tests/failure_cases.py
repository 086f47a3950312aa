"""Float16 failures of the kind users report, rebuilt small, and four ways
to train each: float32, Keras's `LossScaleOptimizer`, the one-line fix an
expert applies by hand (with Keras's optimizer), and tf_als with its
defaults.

Every case builds its model under the current policy from a seed, trains
it on fixed synthetic batches and scores it on held-out ones:

- `dollars`: a regression on prices (targets 50,000-500,000) through a
  float16 output Dense. Its output must reach values float16 cannot hold
  (65504). Fix: the output Dense in float32.
- `instance_norm`: a small segmentation network with three hand-written
  instance normalisations (`tf.reduce_mean` over 256x256 maps). In float16
  the count 65,536 is inf: a positive map's mean is inf / inf = NaN, a
  centred one's mean and variance read 0. Fix: the norms in float32.
- `soft_dice`: a soft-Dice loss summed over the float16 outputs of a
  batch of 256x256 maps, in a custom loop. The sum overflows, the loss sits
  at 1.0 and every gradient is 0; nothing is skipped. Fix: the loss on
  float32 outputs.
- `softmax_top`: keras.applications EfficientNetV2B0 (random weights) with
  its float16 softmax classifier under a cross-entropy on probabilities.
  A learning rate of 1e-2 makes some probabilities small enough that the
  loss's gradient no longer fits float16 at a scale of 1. Fix: the
  classifier in float32.

- `gpt2_mask`: a 2-block character-level GPT-2 whose composite attention
  (`CausalSelfAttention`, two Dense sublayers) masks with GPT-2's first
  constant, 1e10: inf in float16, and inf * 0 makes every logit NaN on the
  first batch. Fix: the mask 1e4 (huggingface/transformers#495).

`run(case, method, seed)` returns a `Result`; `benchmarks/failures.py`
prints the table, `tests/failures/test_failures.py` checks it.
"""

import dataclasses
import warnings
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

import tf_als

layers = keras.layers
METHODS = ("float32", "keras", "fix", "tf_als")


@dataclasses.dataclass(frozen=True)
class Result:
    """One training run.

    Attributes:
        metric: the held-out metric (R2 or IoU or accuracy; higher is better;
            NaN when the weights are not finite).
        skipped: steps skipped (batches run minus steps applied).
        promoted: paths of the layers promoted to float32 (tf_als only).
        scale: the final global loss scale (1.0 for float32).
        warned: the messages of the warnings the run raised.
    """

    metric: float
    skipped: int
    promoted: tuple
    scale: float
    warned: tuple


@dataclasses.dataclass(frozen=True)
class Case:
    """A failure, rebuilt.

    Attributes:
        name: the case's name.
        build: `build(fix)` -> uncompiled model under the current policy
            (`fix`: the manual fix applied).
        data: `data(seed)` -> (train batches [(x, y)], held-out (x, y)).
        loss: the training loss, `loss(y, y_pred)`.
        metric: `metric(y, y_pred)` -> float, higher is better.
        optimizer: `optimizer()` -> a fresh inner optimizer.
        epochs: passes over the train batches.
        custom_loop: train with a GradientTape loop instead of `fit`.
        fixed_loss: the loss the manual fix uses (None: `loss`).
        jit_compile: compile the training step with XLA (what Keras's
            `jit_compile="auto"` chooses on a GPU). Without XLA, TensorFlow's
            float16 convolution gradients have no fast CPU kernel, and the
            two segmentation cases take 2-4 times as long, for the same
            failure and the same results. Measured on seed 0, XLA off / on:
            `instance_norm`, IoU 0.9487 / 0.9487 with the fix, 0.9486 /
            0.9486 with tf_als (norm_0-2 promoted), Keras 0 with XLA;
            `soft_dice`, 0.8984 / 0.8985 with the fix, 0.8674 / 0.8681 with
            tf_als (2 skips, mask promoted), Keras 0.03 with XLA.
            EfficientNetV2B0 (`softmax_top`) stays without XLA: its XLA
            compile costs more than it saves (tf_als's run 365 s).
    """

    name: str
    build: Callable
    data: Callable
    loss: Callable
    metric: Callable
    optimizer: Callable
    epochs: int = 1
    custom_loop: bool = False
    fixed_loss: Callable = None
    jit_compile: bool = False


# -- dollars ------------------------------------------------------------


def _dollars_build(fix):
    inputs = keras.Input((8,))
    x = layers.Dense(32, activation="relu", name="hidden_1")(inputs)
    x = layers.Dense(16, activation="relu", name="hidden_2")(x)
    outputs = layers.Dense(1, name="price", dtype="float32" if fix else None)(x)
    return keras.Model(inputs, outputs)


def _dollars_data(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(640, 8)).astype("float32")
    w = rng.uniform(0.5, 1.5, size=(8,)).astype("float32")
    price = 250_000 + 60_000 * (x @ w) / np.sqrt(8) + 20_000 * np.tanh(x[:, 0] * x[:, 1])
    y = np.clip(price, 50_000, 500_000).astype("float32")[:, None]
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 512, 32)]
    return batches, (x[512:], y[512:])


def _r2(y, y_pred):
    y, y_pred = np.asarray(y, "float64"), np.asarray(y_pred, "float64")
    if not np.all(np.isfinite(y_pred)):
        return float("nan")
    return float(1 - np.sum((y - y_pred) ** 2) / np.sum((y - y.mean()) ** 2))


DOLLARS = Case(
    name="dollars",
    build=_dollars_build,
    data=_dollars_data,
    loss=keras.losses.MeanSquaredError(),
    metric=_r2,
    # Adam at 3.0 (prices are large), decayed to 3e-2 over the run, so that
    # the final weights have settled (at a constant 3.0 the held-out R2 of
    # float32 itself swings between 0.84 and 0.99 from epoch to epoch).
    optimizer=lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.CosineDecay(3.0, decay_steps=480, alpha=0.01)
    ),
    epochs=30,
)


# -- instance_norm and soft_dice ------------------------------------------


class HandInstanceNorm(layers.Layer):
    """Instance normalisation written by hand, as users write it: mean and
    variance over the spatial axes with `tf.reduce_mean`, in the layer's
    compute dtype, then a learned scale and offset."""

    def build(self, input_shape):
        channels = input_shape[-1]
        self.gamma = self.add_weight(shape=(channels,), initializer="ones", name="gamma")
        self.beta = self.add_weight(shape=(channels,), initializer="zeros", name="beta")

    def call(self, x):
        mean = tf.reduce_mean(x, axis=[1, 2], keepdims=True)
        variance = tf.reduce_mean(tf.square(x - mean), axis=[1, 2], keepdims=True)
        normalised = (x - mean) * tf.math.rsqrt(variance + 1e-5)
        return normalised * tf.cast(self.gamma, x.dtype) + tf.cast(self.beta, x.dtype)


def _segmenter(fix_norms, float32_head=True):
    inputs = keras.Input((256, 256, 1))
    x = inputs
    for i in range(3):
        x = layers.Conv2D(4, 3, padding="same", name=f"conv_{i}")(x)
        x = HandInstanceNorm(name=f"norm_{i}", dtype="float32" if fix_norms else None)(x)
        x = layers.Activation("relu")(x)
    outputs = layers.Conv2D(
        1,
        1,
        activation="sigmoid",
        name="mask",
        dtype="float32" if float32_head else None,
    )(x)
    return keras.Model(inputs, outputs)


def _discs(seed, count):
    """Images of noisy discs on a textured background, and their masks."""
    rng = np.random.default_rng(seed)
    grid = np.mgrid[0:256, 0:256].transpose(1, 2, 0)
    x = np.empty((count, 256, 256, 1), "float32")
    y = np.empty((count, 256, 256, 1), "float32")
    for i in range(count):
        centre = rng.uniform(64, 192, size=2)
        radius = rng.uniform(24, 64)
        mask = np.sum((grid - centre) ** 2, axis=-1) < radius**2
        image = 0.4 * mask + rng.normal(0, 0.25, size=(256, 256)) + 0.3
        x[i, ..., 0], y[i, ..., 0] = image, mask
    return x, y


def _segmentation_data(seed, batch=2, train=24):
    x, y = _discs(seed, train + 8)
    batches = [(x[i : i + batch], y[i : i + batch]) for i in range(0, train, batch)]
    return batches, (x[train:], y[train:])


def _iou(y, y_pred):
    y_pred = np.asarray(y_pred, "float32")
    if not np.all(np.isfinite(y_pred)):
        return float("nan")
    predicted, truth = y_pred > 0.5, np.asarray(y) > 0.5
    union = np.logical_or(predicted, truth).sum()
    return float(np.logical_and(predicted, truth).sum() / max(union, 1))


INSTANCE_NORM = Case(
    name="instance_norm",
    build=lambda fix: _segmenter(fix_norms=fix),
    data=_segmentation_data,
    loss=keras.losses.BinaryCrossentropy(),
    metric=_iou,
    optimizer=lambda: keras.optimizers.Adam(1e-2),
    epochs=6,
    jit_compile=True,
)


def soft_dice(y, y_pred):
    """1 - 2 |y p| / (|y| + |p|), summed over the whole batch in y_pred's
    dtype (as users write it)."""
    y = tf.cast(y, y_pred.dtype)
    overlap = tf.reduce_sum(y * y_pred)
    total = tf.reduce_sum(y) + tf.reduce_sum(y_pred)
    return 1.0 - (2.0 * overlap + 1.0) / (total + 1.0)


def soft_dice_float32(y, y_pred):
    """The manual fix: the same loss on float32 outputs."""
    return soft_dice(y, tf.cast(y_pred, "float32"))


SOFT_DICE = Case(
    name="soft_dice",
    build=lambda fix: _segmenter(fix_norms=True, float32_head=False),
    data=lambda seed: _segmentation_data(seed, batch=4),
    loss=soft_dice,
    metric=_iou,
    optimizer=lambda: keras.optimizers.Adam(1e-2),
    epochs=6,
    custom_loop=True,
    fixed_loss=soft_dice_float32,
    jit_compile=True,
)


# -- softmax_top -----------------------------------------------------------


def _efficientnet_build(fix):
    model = keras.applications.EfficientNetV2B0(
        weights=None,
        input_shape=(32, 32, 3),
        classes=10,
        include_preprocessing=False,
    )
    if fix:
        top = model.get_layer("predictions")
        top.dtype_policy = keras.DTypePolicy("float32")
    return model


def _image_classes(seed, classes=10):
    rng = np.random.default_rng(seed)
    prototypes = rng.normal(size=(classes, 32, 32, 3)).astype("float32")
    labels = rng.integers(0, classes, size=(24 * 8 + 64,))
    images = prototypes[labels] + rng.normal(0, 1.0, size=(len(labels), 32, 32, 3))
    x, y = images.astype("float32"), labels.astype("int32")
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 24 * 8, 8)]
    return batches, (x[24 * 8 :], y[24 * 8 :])


def _accuracy(y, y_pred):
    y_pred = np.asarray(y_pred, "float32")
    if not np.all(np.isfinite(y_pred)):
        return float("nan")
    return float(np.mean(np.argmax(y_pred, axis=-1) == np.asarray(y)))


SOFTMAX_TOP = Case(
    name="softmax_top",
    build=_efficientnet_build,
    data=_image_classes,
    loss=keras.losses.SparseCategoricalCrossentropy(),
    metric=_accuracy,
    optimizer=lambda: keras.optimizers.Adam(1e-2),
    epochs=1,
)

# -- gpt2_mask --------------------------------------------------------


class CausalSelfAttention(layers.Layer):
    """GPT-2's attention as its first release wrote it: a composite of two
    Dense sublayers (`c_attn`, `c_proj`) that masks the future in its own
    `call`, between them, as `w * b - mask_value * (1 - b)`. With GPT-2's
    1e10 (inf in float16), `inf * 0` makes every logit NaN at any loss
    scale (huggingface/transformers#382); the fix masks with 1e4
    (transformers#495). The sublayers take no `dtype`, as the original's
    did not: in Keras 3 a `dtype="float32"` on this layer does not reach
    them."""

    def __init__(self, width, heads, mask_value, **kwargs):
        super().__init__(**kwargs)
        self.width, self.heads, self.mask_value = width, heads, mask_value
        self.c_attn = layers.Dense(3 * width, name="c_attn")
        self.c_proj = layers.Dense(width, name="c_proj")

    def build(self, shape):
        self.c_attn.build(shape)
        self.c_proj.build(tuple(shape[:-1]) + (self.width,))

    def get_config(self):
        config = super().get_config()
        config.update(width=self.width, heads=self.heads, mask_value=self.mask_value)
        return config

    def _heads(self, t):
        shape = keras.ops.shape(t)
        t = keras.ops.reshape(t, (shape[0], shape[1], self.heads, -1))
        return keras.ops.transpose(t, (0, 2, 1, 3))

    def call(self, x):
        q, k, v = keras.ops.split(self.c_attn(x), 3, axis=-1)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        w = keras.ops.matmul(q, keras.ops.transpose(k, (0, 1, 3, 2)))
        w = w * keras.ops.cast((self.width // self.heads) ** -0.5, w.dtype)
        n = keras.ops.shape(x)[1]
        b = keras.ops.cast(keras.ops.tril(keras.ops.ones((n, n))), w.dtype)
        w = w * b - keras.ops.cast(self.mask_value, w.dtype) * (1 - b)
        a = keras.ops.matmul(keras.ops.softmax(w, axis=-1), v)
        a = keras.ops.reshape(keras.ops.transpose(a, (0, 2, 1, 3)), keras.ops.shape(x))
        return self.c_proj(a)


def _gpt2_build(fix, vocab=16, width=32, length=24):
    tokens = keras.Input((length,), dtype="int32")
    x = layers.Embedding(vocab, width, name="wte")(tokens)
    x = x + layers.Embedding(length, width, name="wpe")(keras.ops.arange(length))
    for i in range(2):
        h = layers.LayerNormalization(name=f"ln_1_{i}")(x)
        x = x + CausalSelfAttention(width, 2, 1e4 if fix else 1e10, name=f"attn_{i}")(h)
        h = layers.LayerNormalization(name=f"ln_2_{i}")(x)
        h = layers.Dense(2 * width, activation="gelu", name=f"c_fc_{i}")(h)
        x = x + layers.Dense(width, name=f"mlp_proj_{i}")(h)
    x = layers.LayerNormalization(name="ln_f")(x)
    return keras.Model(tokens, layers.Dense(vocab, dtype="float32", name="lm_head")(x))


def _characters(seed, vocab=16, length=24):
    """Sequences of a fixed random Markov chain over `vocab` symbols whose
    next symbol is one of two likely ones (seeded: the chain and the
    draws): next-symbol accuracy is learnable and bounded away from 1."""
    rng = np.random.default_rng(seed)
    likely = rng.integers(0, vocab, size=(vocab, 2))
    sequences = np.empty((48 * 8 + 64, length + 1), "int32")
    sequences[:, 0] = rng.integers(0, vocab, size=len(sequences))
    for t in range(length):
        pick = rng.random(len(sequences))
        follow = likely[sequences[:, t], (pick < 0.7).astype(int)]
        noise = rng.integers(0, vocab, size=len(sequences))
        sequences[:, t + 1] = np.where(pick < 0.9, follow, noise)
    x, y = sequences[:, :-1], sequences[:, 1:]
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 48 * 8, 8)]
    return batches, (x[48 * 8 :], y[48 * 8 :])


GPT2_MASK = Case(
    name="gpt2_mask",
    build=_gpt2_build,
    data=_characters,
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metric=_accuracy,
    optimizer=lambda: keras.optimizers.Adam(3e-3),
    epochs=2,
)



class DecoderBlock(layers.Layer):
    """A KerasHub-style pre-norm decoder block: its attention
    (`CausalSelfAttention`, itself a composite) and MLP are sublayers of
    the block, so the failing code sits two composites deep."""

    def __init__(self, width, mask_value, **kwargs):
        super().__init__(**kwargs)
        self.width, self.mask_value = width, mask_value
        self.ln_1 = layers.LayerNormalization(name="ln_1")
        self.attn = CausalSelfAttention(width, 2, mask_value, name="attn")
        self.ln_2 = layers.LayerNormalization(name="ln_2")
        self.c_fc = layers.Dense(2 * width, activation="gelu", name="c_fc")
        self.mlp_proj = layers.Dense(width, name="mlp_proj")

    def build(self, shape):
        for layer in (self.ln_1, self.attn, self.ln_2):
            layer.build(shape)
        self.c_fc.build(shape)
        self.mlp_proj.build(tuple(shape[:-1]) + (2 * self.width,))

    def get_config(self):
        config = super().get_config()
        config.update(width=self.width, mask_value=self.mask_value)
        return config

    def call(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(self.c_fc(self.ln_2(x)))


def _gpt2_block_build(fix, vocab=16, width=32, length=24):
    tokens = keras.Input((length,), dtype="int32")
    x = layers.Embedding(vocab, width, name="wte")(tokens)
    x = x + layers.Embedding(length, width, name="wpe")(keras.ops.arange(length))
    for i in range(2):
        x = DecoderBlock(width, 1e4 if fix else 1e10, name=f"block_{i}")(x)
    x = layers.LayerNormalization(name="ln_f")(x)
    return keras.Model(tokens, layers.Dense(vocab, dtype="float32", name="lm_head")(x))


class CharacterGPT(keras.Model):
    """The same character model, subclassed: the blocks are attributes of
    the model and its own `call` runs them."""

    def __init__(self, fix=False, vocab=16, width=32, length=24, **kwargs):
        super().__init__(**kwargs)
        self.fix, self.vocab, self.width, self.length = fix, vocab, width, length
        self.wte = layers.Embedding(vocab, width, name="wte")
        self.wpe = layers.Embedding(length, width, name="wpe")
        mask = 1e4 if fix else 1e10
        self.blocks = [DecoderBlock(width, mask, name=f"block_{i}") for i in range(2)]
        self.ln_f = layers.LayerNormalization(name="ln_f")
        self.lm_head = layers.Dense(vocab, dtype="float32", name="lm_head")

    def get_config(self):
        return {**super().get_config(), "fix": self.fix, "vocab": self.vocab,
                "width": self.width, "length": self.length}

    def call(self, tokens):
        x = self.wte(tokens) + self.wpe(keras.ops.arange(self.length))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _gpt2_subclassed_build(fix):
    model = CharacterGPT(fix)
    model(np.zeros((1, 24), "int32"))
    return model


GPT2_MASK_BLOCK = dataclasses.replace(GPT2_MASK, name="gpt2_mask_block", build=_gpt2_block_build)
GPT2_MASK_SUBCLASSED = dataclasses.replace(
    GPT2_MASK, name="gpt2_mask_subclassed", build=_gpt2_subclassed_build
)

CASES = {c.name: c for c in (DOLLARS, INSTANCE_NORM, SOFT_DICE, SOFTMAX_TOP, GPT2_MASK)}


# -- reported: noisy_or, exp_loss, variance_norm, and gpt2_mask's attention in a
# KerasHub-style block and in a subclassed model (not in CASES: benchmarks/failures.py only)


def _digits():
    """scikit-learn's 8x8 digits, pixels 0-16 as the dataset gives them."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.data.astype("float32"), digits.target.astype("int32")


class NoisyOrPool(layers.Layer):
    """Noisy-OR pooling of a bag's instance probabilities (last axis),
    `1 - prod(1 - p)` through `log1p`, with the clamp of
    fastino-ai/GLiNER2#155: `p.clamp(max=1 - 1e-6)`. Float16 rounds
    `1 - 1e-6` to 1.0, so a saturated instance (sigmoid above ~8.3 rounds
    to 1.0) gives `log1p(-1) = -inf`: the bag's probability is still a
    finite 1.0, but its backward pass is `0 * inf = NaN` at any loss scale.
    The fix is a margin float16 holds next to 1 (`1 - 1e-3`)."""

    def __init__(self, margin=1e-6, **kwargs):
        super().__init__(**kwargs)
        self.margin = margin

    def get_config(self):
        return {**super().get_config(), "margin": self.margin}

    def call(self, p):
        p = keras.ops.minimum(p, keras.ops.cast(1.0 - self.margin, p.dtype))
        return 1.0 - keras.ops.exp(keras.ops.sum(keras.ops.log1p(-p), axis=-1, keepdims=True))


def _noisy_or_build(fix, instances=8):
    inputs = keras.Input((instances, 64))
    x = layers.Dense(32, activation="relu", name="hidden")(inputs)
    x = layers.Dense(1, activation="sigmoid", name="instance_prob")(x)
    x = layers.Reshape((instances,))(x)
    return keras.Model(inputs, NoisyOrPool(1e-3 if fix else 1e-6, name="noisy_or")(x))


def _bags(seed, instances=8, target=0, train_bags=48 * 8, test_bags=256):
    """Multiple-instance learning on digits: a bag of `instances` digit
    images is positive when one of them is a `target`. Train and held-out
    bags are drawn (seeded) from disjoint halves of the images; raw pixels
    (0-16), as users feed them."""
    x, digit = _digits()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    split = len(x) * 2 // 3

    def draw(pool, count):
        picks = rng.choice(pool, size=(count, instances))
        return x[picks], np.any(digit[picks] == target, axis=1).astype("float32")[:, None]

    bx, by = draw(order[:split], train_bags)
    batches = [(bx[i : i + 8], by[i : i + 8]) for i in range(0, train_bags, 8)]
    return batches, draw(order[split:], test_bags)


def _bag_accuracy(y, y_pred):
    y_pred = np.asarray(y_pred, "float32")
    if not np.all(np.isfinite(y_pred)):
        return float("nan")
    return float(np.mean((y_pred > 0.5) == (np.asarray(y) > 0.5)))


NOISY_OR = Case(
    name="noisy_or",
    build=_noisy_or_build,
    data=_bags,
    loss=keras.losses.BinaryCrossentropy(),
    metric=_bag_accuracy,
    optimizer=lambda: keras.optimizers.Adam(1e-2),
    epochs=2,
)


class HandLogSoftmax(layers.Layer):
    """Log-probabilities written by hand, `z - log(sum(exp(z)))`, with no
    max subtracted: in float16 `exp` overflows above 11.09, `log(inf)` is
    inf and a row's log-probabilities are -inf (the forward pass, at any
    loss scale). Reported: tensorflow/tensorflow#59826, keras.io's
    Forward-Forward example stops learning under mixed_float16; its layers
    exponentiate their goodness in their float16 compute dtype
    (`log(1 + exp(g - threshold))`, with no max subtracted). That thread
    closed stale, without a fix; the fix here is the one
    tensorflow/tensorflow#10142 and uTensor/uTensor#175 (fixed in #176)
    give for an overflowing `exp`: subtract the max first (`stable=True`),
    which keeps the layer in float16."""

    def __init__(self, stable=False, **kwargs):
        super().__init__(**kwargs)
        self.stable = stable

    def get_config(self):
        return {**super().get_config(), "stable": self.stable}

    def call(self, z):
        shift = keras.ops.zeros_like(z[..., :1])
        if self.stable:
            shift = keras.ops.max(z, axis=-1, keepdims=True)
        total = keras.ops.sum(keras.ops.exp(z - shift), axis=-1, keepdims=True)
        return z - (shift + keras.ops.log(total))


def _exp_logsumexp_build(fix):
    inputs = keras.Input((64,))
    x = layers.Dense(64, activation="relu", name="hidden")(inputs)
    logits = layers.Dense(10, name="logits")(x)
    return keras.Model(inputs, HandLogSoftmax(stable=fix, name="log_softmax")(logits))


def _digit_classes(seed, train=40 * 16):
    """Digits classification on raw pixels (0-16), as the dataset gives
    them: the logits start near float16's `exp` limit and pass it within
    the first steps."""
    x, y = _digits()
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, train, 16)]
    return batches, (x[train:], y[train:])


def _nll(y, log_probs):
    """Negative log-likelihood of integer labels under log-probabilities."""
    y = keras.ops.cast(keras.ops.reshape(y, (-1, 1)), "int32")
    return -keras.ops.mean(keras.ops.take_along_axis(log_probs, y, axis=-1))


EXP_LOSS = Case(
    name="exp_loss",
    build=_exp_logsumexp_build,
    data=_digit_classes,
    loss=_nll,
    metric=_accuracy,
    optimizer=lambda: keras.optimizers.Adam(3e-3),
    epochs=3,
)

class ProjectNorm(layers.Layer):
    """A composite: a Dense projection (sublayer `proj`), then a
    normalisation written in its own `call` with the one-pass variance
    `mean(h**2) - mean(h)**2` over the whole feature map. On raw 0-255
    pixels the projection passes 256, and its square passes float16's
    65504: neuroneural/brainchop-cli#56 (a GroupNorm variance squared in
    float16, "any conv output > ~256 overflows"; fixed by computing the
    statistics in float32) and cellarium-ai/cellarium-ml#113 (the same
    one-pass `E[x**2] - E[x]**2`, NaN in float16). The fix:
    `float32_stats=True`, the statistics on a float32 copy."""

    def __init__(self, width, float32_stats=False, **kwargs):
        super().__init__(**kwargs)
        self.width, self.float32_stats = width, float32_stats
        self.proj = layers.Dense(width, name="proj")

    def build(self, shape):
        self.proj.build(shape)

    def get_config(self):
        config = super().get_config()
        config.update(width=self.width, float32_stats=self.float32_stats)
        return config

    def call(self, x):
        h = self.proj(x)
        stats = keras.ops.cast(h, "float32") if self.float32_stats else h
        axes = tuple(range(1, len(h.shape)))
        mean = keras.ops.mean(stats, axis=axes, keepdims=True)
        variance = keras.ops.mean(stats * stats, axis=axes, keepdims=True) - mean * mean
        normalised = (stats - mean) * keras.ops.rsqrt(variance + 1e-3)
        return keras.ops.cast(normalised, h.dtype)


def _variance_norm_build(fix):
    inputs = keras.Input((2, 32))
    x = ProjectNorm(32, float32_stats=fix, name="project_norm")(inputs)
    x = layers.Activation("relu")(x)
    x = layers.Flatten()(x)
    return keras.Model(inputs, layers.Dense(10, name="classes")(x))


def _digit_images(seed, train=40 * 16):
    """Digits as 2 halves (32 pixels each) of 0-255 (what a uint8 image
    holds), not rescaled, as users feed them: the projection starts past
    256 on every image."""
    batches, (x, y) = _digit_classes(seed, train)
    image = lambda a: (a * 255 / 16).reshape(-1, 2, 32)
    return [(image(a), b) for a, b in batches], (image(x), y)


VARIANCE_NORM = Case(
    name="variance_norm",
    build=_variance_norm_build,
    data=_digit_images,
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metric=_accuracy,
    optimizer=lambda: keras.optimizers.Adam(3e-3),
    epochs=3,
)

# Rebuilt from public reports; `benchmarks/failures.py` runs them, the slow
# suite (which iterates `CASES`) does not.
REPORTED = {
    c.name: c
    for c in (
        NOISY_OR, EXP_LOSS, VARIANCE_NORM, GPT2_MASK_BLOCK, GPT2_MASK_SUBCLASSED,
    )
}


# -- running ------------------------------------------------------------


def run(case: Case, method: str, seed: int, **tf_als_options) -> Result:
    """Trains `case` one way (`METHODS`) from seed `seed`'s weights and
    batches; every method starts from the same weights."""
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}; received {method!r}.")
    batches, (x_test, y_test) = case.data(seed)
    model = _build(case, method, seed)
    loss = case.fixed_loss if (method == "fix" and case.fixed_loss) else case.loss
    optimizer = _optimizer(case, method, tf_als_options)
    if method == "tf_als":
        model = tf_als.instrument(model, **_instrument_options(tf_als_options))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case.custom_loop:
            _custom_loop(model, optimizer, loss, batches, case.epochs, case.jit_compile)
        else:
            _fit(model, optimizer, loss, batches, case.epochs, case.jit_compile)
    applied = int(optimizer.iterations.numpy())
    scale = 1.0
    if method != "float32":
        scale = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
    promoted = ()
    if method == "tf_als":
        promoted = tuple(p.layer for p in tf_als.promoted(model))
    y_pred = model.predict(x_test, batch_size=8, verbose=0)
    return Result(
        metric=case.metric(y_test, y_pred),
        skipped=len(batches) * case.epochs - applied,
        promoted=promoted,
        scale=scale,
        warned=tuple(
            str(w.message) for w in caught if not issubclass(w.category, DeprecationWarning)
        ),
    )


def _instrument_options(options):
    return {k: options.pop(k) for k in ("float32_outputs",) if k in options}


# The float32 build's initial weights per (case, seed): every method starts
# from them, and each run of the other three would otherwise build the
# float32 model again only to read them (two of the five builds of
# EfficientNetV2B0 in `softmax_top`). `keras.utils.set_random_seed(seed)`
# comes before every build, so a cached copy is the array a new build gives.
_INITIAL_WEIGHTS = {}


def _build(case, method, seed):
    key = (case, seed)
    if method == "float32" or key not in _INITIAL_WEIGHTS:
        keras.mixed_precision.set_global_policy("float32")
        keras.utils.set_random_seed(seed)
        reference = case.build(False)
        _INITIAL_WEIGHTS[key] = reference.get_weights()
        if method == "float32":
            return reference
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(seed)
    model = case.build(method == "fix")
    model.set_weights(_INITIAL_WEIGHTS[key])
    keras.mixed_precision.set_global_policy("float32")
    return model


def _optimizer(case, method, options):
    inner = case.optimizer()
    if method == "float32":
        return inner
    if method == "tf_als":
        return tf_als.AdaptiveLossScaleOptimizer(inner, **options)
    return keras.optimizers.LossScaleOptimizer(inner)


def _fit(model, optimizer, loss, batches, epochs, jit_compile):
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    model.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile)
    model.fit(x, y, batch_size=len(batches[0][0]), epochs=epochs, shuffle=False, verbose=0)


def _custom_loop(model, optimizer, loss, batches, epochs, jit_compile):
    if isinstance(model, tf_als.InstrumentedModel):
        model.compile(optimizer=optimizer)
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    @tf.function(jit_compile=jit_compile)
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
            if scaled:
                value = optimizer.scale_loss(value)
        grads = tape.gradient(value, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    for _ in range(epochs):
        for x, y in batches:
            step(x, y)
            if isinstance(optimizer, tf_als.AdaptiveLossScaleOptimizer):
                if optimizer.check_skips(batches=lambda: [(x, y)], loss=loss):
                    step = tf.function(step.python_function, jit_compile=jit_compile)
