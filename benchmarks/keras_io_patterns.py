"""Two keras.io training patterns rebuilt at CPU scale, each trained four
ways from the same initial weights on the same batches (and the same noise):

- `float32`: policy float32, the plain Keras optimizer;
- `keras`: mixed_float16, `keras.optimizers.LossScaleOptimizer` on the
  plain models;
- `tf_als`: every trained network instrumented with `tf_als.instrument`,
  each optimizer an `AdaptiveLossScaleOptimizer`, nothing else added;
- `tf_als_preflight`: as `tf_als`, plus the `optimizer.preflight(model,
  batches, step_loss=...)` call docs/training-loops.md describes, once per
  optimizer before `fit`.

The patterns (the code is this file's own, in keras.io's shape):

- `ddim`: keras.io's "Denoising Diffusion Implicit Models". A residual
  U-Net `network` (Functional: widths 16/32/48, one residual block a level,
  BatchNormalization without scale and centre, a sinusoidal embedding of
  the noise variance as a second input, a zero-initialised last
  convolution) inside a `DiffusionModel(keras.Model)` whose own
  `train_step` samples noise and diffusion times (cosine schedule), mixes
  images and noise, predicts the noise with the network, takes the loss on
  a float32 cast, scales it, differentiates and `self.optimizer.apply`s,
  then moves an EMA network, made with `keras.models.clone_model(network)`,
  by `ema_weight.assign(0.999 * ema_weight + 0.001 * weight)`. As in
  keras.io, the step calls `self.network` directly and the model `fit` runs
  is the wrapper: in `tf_als` the network is instrumented (docs: "network =
  tf_als.instrument(get_network(...))"), the wrapper is not (it has no
  `call` of its own). Data: scikit-learn's digits, 8x8 upsampled to
  16x16, normalised to mean 0 and variance 1 (keras.io's Normalization
  layer). The loss is the mean absolute error *summed over each image's
  pixels* and averaged over the batch (the DDPM paper's ||eps -
  eps_theta||, written per image as many users write it, rather than
  keras.io's per-pixel mean): at Keras's initial scale 2**15 the last
  convolution's weight gradient (a sum over batch x 256 pixels) overflows
  float16, so the first steps skip, as in the report this rebuilds. Adam
  (AdamW in keras.io) 1e-3.
- `cgan`: keras.io's "Conditional GAN" on the digits (8x8, pixel values
  in [0, 1]): a generator of latent noise concatenated with one-hot
  labels (Dense, reshape, a transposed convolution, a sigmoid
  convolution), a discriminator of the image concatenated with its labels
  broadcast as channels (two strided convolutions, global max pooling, a
  linear score), and a `ConditionalGAN(keras.Model)` whose own
  `train_step` trains both with two Adam optimizers (binary
  cross-entropy on logits), run by `gan.fit`. The latent noise is drawn
  inside the step from a seeded `keras.random.SeedGenerator`.

The EMA's start is set to the network's initial weights (Keras's clone has
freshly initialised ones), so that every variant's EMA starts alike.
`preflight` runs the step's loss eagerly and draws from the wrapper's
seed generator; the benchmark puts that state back after it (and reports
whether it had moved) so that every variant sees the same noise.

Reported per pattern and variant, one value per seed: the steps each
optimizer skipped, its final global scale (`dynamic_scale`), the smallest
and largest per-layer scale (`tf_als.scales`) of each instrumented model,
the relative L2 distance of the trained weights (the DDIM's network and
its EMA, the GAN's generator) to float32's, ||w - w32|| / ||w32|| over the
trainable weights, and the final losses (the mean over the last epoch).

`--clone-table` instead runs a quick check of `keras.models.clone_model`
on instrumented Functional, Sequential, subclassed (registered and not)
models and a tiny KerasHub GPT2Backbone: what comes back, and whether its
weights line up with the original's. Each part updates its own section of
benchmarks/results/keras_io_patterns.{md,json}.

    python benchmarks/keras_io_patterns.py                  # both patterns, 3 seeds
    python benchmarks/keras_io_patterns.py --seeds 0 --patterns ddim
    python benchmarks/keras_io_patterns.py --clone-table
"""

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tf_als  # noqa: E402

VARIANTS = ("float32", "keras", "tf_als", "tf_als_preflight")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MACHINE = "AMD EPYC, 2 cores, CPU only"


# --- data -----------------------------------------------------------------


def digits(seed):
    """scikit-learn's digits (8x8, values 0-16) as float32 images with one
    channel and one-hot labels, in an order drawn from `seed`."""
    data = load_digits()
    order = np.random.default_rng(seed).permutation(len(data.images))
    images = data.images[order].astype("float32")[..., None]
    labels = keras.utils.to_categorical(data.target[order], 10).astype("float32")
    return images, labels


def ddim_images(seed):
    """The digits upsampled to 16x16 and normalised (mean 0, variance 1)."""
    images = np.repeat(np.repeat(digits(seed)[0], 2, axis=1), 2, axis=2)
    return ((images - images.mean()) / images.std()).astype("float32")


# --- the DDIM ---------------------------------------------------------------


@keras.saving.register_keras_serializable(package="keras_io_patterns")
class NoiseEmbedding(keras.layers.Layer):
    """Sines and cosines of the noise variance at `dims // 2` frequencies
    from 1 to `max_frequency`, computed in float32."""

    def __init__(self, dims=16, max_frequency=100.0, **kwargs):
        super().__init__(**kwargs)
        self.dims = dims
        self.max_frequency = max_frequency

    def call(self, variances):
        variances = keras.ops.cast(variances, "float32")
        frequencies = keras.ops.exp(
            keras.ops.linspace(0.0, math.log(self.max_frequency), self.dims // 2)
        )
        angles = 2.0 * math.pi * frequencies * variances
        embedding = keras.ops.concatenate([keras.ops.sin(angles), keras.ops.cos(angles)], -1)
        return keras.ops.cast(embedding, self.compute_dtype)

    def compute_output_shape(self, shape):
        return tuple(shape[:-1]) + (self.dims,)

    def get_config(self):
        return {**super().get_config(), "dims": self.dims, "max_frequency": self.max_frequency}


def residual_block(x, width):
    residual = x if x.shape[-1] == width else keras.layers.Conv2D(width, 1)(x)
    x = keras.layers.BatchNormalization(center=False, scale=False)(x)
    x = keras.layers.Conv2D(width, 3, padding="same", activation="swish")(x)
    x = keras.layers.Conv2D(width, 3, padding="same")(x)
    return keras.layers.Add()([x, residual])


def get_network(size=16, widths=(16, 32, 48), depth=1, seed=0):
    """The residual U-Net: noisy images and noise variances in, the
    predicted noise out."""
    keras.utils.set_random_seed(seed)
    images = keras.Input((size, size, 1))
    variances = keras.Input((1, 1, 1))
    embedding = NoiseEmbedding(16)(variances)
    embedding = keras.layers.UpSampling2D(size, interpolation="nearest")(embedding)
    x = keras.layers.Conv2D(widths[0], 1)(images)
    x = keras.layers.Concatenate()([x, embedding])
    skips = []
    for width in widths[:-1]:
        for _ in range(depth):
            x = residual_block(x, width)
            skips.append(x)
        x = keras.layers.AveragePooling2D(2)(x)
    for _ in range(depth):
        x = residual_block(x, widths[-1])
    for width in reversed(widths[:-1]):
        x = keras.layers.UpSampling2D(2, interpolation="bilinear")(x)
        for _ in range(depth):
            x = residual_block(keras.layers.Concatenate()([x, skips.pop()]), width)
    out = keras.layers.Conv2D(1, 1, kernel_initializer="zeros")(x)
    return keras.Model([images, variances], out, name="residual_unet")


class DiffusionModel(keras.Model):
    """keras.io's DDIM training: its own `train_step` and an EMA network."""

    def __init__(self, network, seed=0, ema=0.999, **kwargs):
        super().__init__(**kwargs)
        self.network = network
        self.ema_network = keras.models.clone_model(network)
        self.ema_network.set_weights(network.get_weights())
        self.ema = ema
        self.noise_seeds = keras.random.SeedGenerator(seed)
        self.loss_tracker = keras.metrics.Mean(name="n_loss")

    @property
    def metrics(self):
        return [self.loss_tracker]

    def diffusion_schedule(self, times):
        """keras.io's cosine schedule: signal rates from 0.95 to 0.02."""
        start, end = math.acos(0.95), math.acos(0.02)
        angles = start + times * (end - start)
        return keras.ops.sin(angles), keras.ops.cos(angles)

    def diffuse(self, images):
        """Noise, the noisy images and the noise rates of one batch."""
        noises = keras.random.normal(keras.ops.shape(images), seed=self.noise_seeds)
        times = keras.random.uniform(
            (keras.ops.shape(images)[0], 1, 1, 1), seed=self.noise_seeds
        )
        noise_rates, signal_rates = self.diffusion_schedule(times)
        return noises, signal_rates * images + noise_rates * noises, noise_rates

    def noise_loss(self, noises, noisy, noise_rates):
        """The absolute error of the predicted noise, summed over each
        image's pixels and averaged over the batch, on a float32 cast."""
        predicted = self.network([noisy, noise_rates**2], training=True)
        error = keras.ops.abs(noises - keras.ops.cast(predicted, "float32"))
        return keras.ops.mean(keras.ops.sum(error, axis=(1, 2, 3)))

    def step_loss(self, images):
        """The loss `train_step` differentiates, from one batch."""
        return self.noise_loss(*self.diffuse(images))

    def train_step(self, data):
        images, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        noises, noisy, noise_rates = self.diffuse(images)
        with tf.GradientTape() as tape:
            loss = self.noise_loss(noises, noisy, noise_rates)
            scaled = self.optimizer.scale_loss(loss)
        variables = self.network.trainable_weights
        self.optimizer.apply(tape.gradient(scaled, variables), variables)
        for weight, ema_weight in zip(self.network.weights, self.ema_network.weights):
            ema_weight.assign(self.ema * ema_weight + (1.0 - self.ema) * weight)
        self.loss_tracker.update_state(loss)
        return {m.name: m.result() for m in self.metrics}


# --- the conditional GAN ------------------------------------------------------

LATENT = 16
CLASSES = 10


def get_generator(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((LATENT + CLASSES,))
    x = keras.layers.Dense(4 * 4 * 32)(inputs)
    x = keras.layers.LeakyReLU(0.2)(x)
    x = keras.layers.Reshape((4, 4, 32))(x)
    x = keras.layers.Conv2DTranspose(32, 4, strides=2, padding="same")(x)
    x = keras.layers.LeakyReLU(0.2)(x)
    out = keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid")(x)
    return keras.Model(inputs, out, name="generator")


def get_discriminator(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 1 + CLASSES))
    x = keras.layers.Conv2D(32, 3, strides=2, padding="same")(inputs)
    x = keras.layers.LeakyReLU(0.2)(x)
    x = keras.layers.Conv2D(64, 3, strides=2, padding="same")(x)
    x = keras.layers.LeakyReLU(0.2)(x)
    x = keras.layers.GlobalMaxPooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(1)(x), name="discriminator")


class ConditionalGAN(keras.Model):
    """keras.io's conditional GAN step: the discriminator on real and
    generated images with their labels, then the generator through it."""

    def __init__(self, generator, discriminator, seed=0, **kwargs):
        super().__init__(**kwargs)
        self.generator = generator
        self.discriminator = discriminator
        self.latent_seeds = keras.random.SeedGenerator(seed)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def generate(self, labels):
        noise = keras.random.normal((keras.ops.shape(labels)[0], LATENT), seed=self.latent_seeds)
        return self.generator(keras.ops.concatenate([noise, labels], -1), training=True)

    def judge(self, images, labels):
        """The discriminator's logits for images with their labels as
        channels."""
        channels = keras.ops.broadcast_to(labels[:, None, None, :], (keras.ops.shape(labels)[0], 8, 8, CLASSES))
        images = keras.ops.cast(images, "float32")
        return self.discriminator(keras.ops.concatenate([images, channels], -1), training=True)

    def discriminator_loss(self, real, labels):
        fake = self.generate(labels)
        logits = self.judge(keras.ops.concatenate([fake, real], 0), keras.ops.concatenate([labels, labels], 0))
        batch = keras.ops.shape(labels)[0]
        targets = keras.ops.concatenate([keras.ops.ones((batch, 1)), keras.ops.zeros((batch, 1))], 0)
        return self.loss_fn(targets, logits)

    def generator_loss(self, labels):
        logits = self.judge(self.generate(labels), labels)
        return self.loss_fn(keras.ops.zeros_like(logits), logits)  # "all real"

    def train_step(self, data):
        real, labels = data
        with tf.GradientTape() as tape:
            d_loss = self.discriminator_loss(real, labels)
            scaled = self.d_optimizer.scale_loss(d_loss)
        variables = self.discriminator.trainable_weights
        self.d_optimizer.apply(tape.gradient(scaled, variables), variables)
        with tf.GradientTape() as tape:
            g_loss = self.generator_loss(labels)
            scaled = self.g_optimizer.scale_loss(g_loss)
        variables = self.generator.trainable_weights
        self.g_optimizer.apply(tape.gradient(scaled, variables), variables)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {m.name: m.result() for m in self.metrics}


# --- one run ------------------------------------------------------------------


def _start(variant):
    keras.backend.clear_session(free_memory=False)  # (resets the policy)
    keras.mixed_precision.set_global_policy(
        "float32" if variant == "float32" else "mixed_float16"
    )


def _optimizer(variant, rate):
    inner = keras.optimizers.Adam(rate)
    if variant == "float32":
        return inner
    if variant == "keras":
        return keras.optimizers.LossScaleOptimizer(inner)
    return tf_als.AdaptiveLossScaleOptimizer(inner)


def _model(variant, model):
    return tf_als.instrument(model) if variant.startswith("tf_als") else model


def _restoring(seed_generator, check):
    """Runs `check()`, puts `seed_generator`'s state back; whether it had
    moved."""
    before = np.array(seed_generator.state.numpy())
    check()
    moved = not np.array_equal(before, seed_generator.state.numpy())
    seed_generator.state.assign(before)
    return moved


def _optimizer_report(optimizer, steps, model):
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    scale = getattr(optimizer, "dynamic_scale", None)
    report = {
        "skipped": steps - int(inner.iterations.numpy()),
        "scale": None if scale is None else float(scale.numpy()),
    }
    if isinstance(model, tf_als.InstrumentedModel):
        values = list(tf_als.scales(model).values())
        report["layer_scales"] = [float(min(values)), float(max(values))]
        report["promoted"] = [str(p) for p in tf_als.promoted(model)]
    return report


def _weights(model):
    return [np.array(w.numpy(), np.float64) for w in model.trainable_weights]


def ddim(variant, seed, args):
    _start(variant)
    images = ddim_images(seed)[: args.ddim_steps_per_epoch * args.ddim_batch]
    network = _model(variant, get_network(seed=seed))
    model = DiffusionModel(network, seed=seed)
    model.compile(optimizer=_optimizer(variant, 1e-3))
    model.jit_compile = args.xla == "on"
    seed_moved = None
    if variant == "tf_als_preflight":
        first = images[: args.ddim_batch]
        seed_moved = _restoring(model.noise_seeds, lambda: model.optimizer.preflight(
            model.network, lambda: [first], step_loss=model.step_loss))
    started = time.perf_counter()
    history = model.fit(images, batch_size=args.ddim_batch, epochs=args.ddim_epochs,
                        shuffle=False, verbose=0)
    steps = args.ddim_epochs * args.ddim_steps_per_epoch
    return {
        "seconds": time.perf_counter() - started,
        "steps": steps,
        "losses": {"n_loss": float(history.history["n_loss"][-1])},
        "optimizers": {"network": _optimizer_report(model.optimizer, steps, model.network)},
        "ema_instrumented": isinstance(model.ema_network, tf_als.InstrumentedModel),
        "preflight_moved_seed": seed_moved,
        "weights": {"network": _weights(model.network), "ema": _weights(model.ema_network)},
    }


def cgan(variant, seed, args):
    _start(variant)
    images, labels = digits(seed)
    count = args.gan_steps_per_epoch * args.gan_batch
    images, labels = images[:count] / 16.0, labels[:count]
    generator = _model(variant, get_generator(seed))
    discriminator = _model(variant, get_discriminator(seed + 100))
    gan = ConditionalGAN(generator, discriminator, seed=seed)
    gan.compile(d_optimizer=_optimizer(variant, 3e-4), g_optimizer=_optimizer(variant, 3e-4))
    gan.jit_compile = args.xla == "on"
    seed_moved = None
    if variant == "tf_als_preflight":
        first = (images[: args.gan_batch], labels[: args.gan_batch])

        def check():
            gan.d_optimizer.preflight(discriminator, lambda: [first],
                                      step_loss=lambda b: gan.discriminator_loss(*b))
            gan.g_optimizer.preflight(generator, lambda: [first],
                                      step_loss=lambda b: gan.generator_loss(b[1]))

        seed_moved = _restoring(gan.latent_seeds, check)
    started = time.perf_counter()
    history = gan.fit(images, labels, batch_size=args.gan_batch, epochs=args.gan_epochs,
                      shuffle=False, verbose=0)
    steps = args.gan_epochs * args.gan_steps_per_epoch
    return {
        "seconds": time.perf_counter() - started,
        "steps": steps,
        "losses": {k: float(history.history[k][-1]) for k in ("d_loss", "g_loss")},
        "optimizers": {
            "discriminator": _optimizer_report(gan.d_optimizer, steps, discriminator),
            "generator": _optimizer_report(gan.g_optimizer, steps, generator),
        },
        "preflight_moved_seed": seed_moved,
        "weights": {"generator": _weights(generator)},
    }


class CallableDiffusionModel(DiffusionModel):
    """The DDIM's wrapper with a `call` (keras.io's has none), so that it
    can be built and instrumented; its step still calls `self.network`."""

    def call(self, inputs, training=False):
        return self.network(inputs, training=training)


def _outcome(action):
    try:
        action()
    except Exception as error:  # noqa: BLE001 - reported
        message = " ".join(str(error).split()).replace("`", "'")
        return f"{type(error).__name__}: {message[:200]}"
    return "ok"


def wrapper_check(seed, args):
    """What a user who wants `fit`'s automatic check on the DDIM meets:
    `tf_als.instrument` of keras.io's wrapper, and of one given a `call`
    and built (its network plain), then `fit` on 2 batches."""
    _start("tf_als")
    images = ddim_images(seed)[: 2 * args.ddim_batch]
    found = {"instrument(DiffusionModel)": _outcome(
        lambda: tf_als.instrument(DiffusionModel(get_network(seed=seed)))
    )}
    model = CallableDiffusionModel(get_network(seed=seed))
    model([images[:2], np.ones((2, 1, 1, 1), "float32")])

    def fit():
        wrapped = tf_als.instrument(model)
        wrapped.compile(optimizer=_optimizer("tf_als", 1e-3))
        wrapped.fit(images, batch_size=args.ddim_batch, epochs=1, shuffle=False, verbose=0)

    found["instrument(wrapper with a call), then fit"] = _outcome(fit)
    return found


def _distance(weights, reference):
    difference = sum(float(np.sum((w - r) ** 2)) for w, r in zip(weights, reference))
    return math.sqrt(difference / sum(float(np.sum(r**2)) for r in reference))


def run_pattern(name, train, seeds, args):
    """Every variant on every seed (float32 first, the reference); weights
    replaced by their distance to float32's."""
    runs = []
    for seed in seeds:
        reference = None
        for variant in ("float32",) + tuple(v for v in args.variants.split(",") if v != "float32"):
            result = train(variant, seed, args)
            weights = result.pop("weights")
            if variant == "float32":
                reference = weights
            result["distance"] = {
                k: _distance(weights[k], reference[k]) for k in weights
            }
            result.update(pattern=name, variant=variant, seed=seed)
            runs.append(result)
            print(f"{name} seed {seed} {variant}: {_summary(result)} "
                  f"({result['seconds']:.1f} s)", flush=True)
    return runs


# --- tables -------------------------------------------------------------------


def _log2(value):
    if value is None:
        return "-"
    if value <= 0 or not math.isfinite(value):
        return str(value)
    return f"2**{math.log2(value):g}"


def _summary(run):
    skipped = ", ".join(f"{k} {o['skipped']}" for k, o in run["optimizers"].items())
    distance = ", ".join(f"{k} {v:.2e}" for k, v in run["distance"].items())
    return f"skipped {skipped}; distance {distance}"


def _cells(runs, cell):
    return " / ".join(cell(r) for r in runs)


def pattern_table(runs):
    """One row per pattern and variant; a cell holds one value per seed
    (`a / b / c`)."""
    seeds = sorted({r["seed"] for r in runs})
    lines = [
        f"Seeds {', '.join(map(str, seeds))}; each cell lists one value per seed.",
        "",
        "| pattern | variant | optimizer | skipped | final global scale | per-layer scales (min, max) "
        "| distance to float32 | final losses |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for pattern in dict.fromkeys(r["pattern"] for r in runs):
        for variant in VARIANTS:
            chosen = [r for r in runs if r["pattern"] == pattern and r["variant"] == variant]
            if not chosen:
                continue
            distance = "; ".join(
                f"{k} " + _cells(chosen, lambda r, k=k: f"{r['distance'][k]:.2e}")
                for k in chosen[0]["distance"]
            )
            losses = "; ".join(
                f"{k} " + _cells(chosen, lambda r, k=k: f"{r['losses'][k]:.4f}")
                for k in chosen[0]["losses"]
            )
            for i, name in enumerate(chosen[0]["optimizers"]):
                of = lambda r, name=name: r["optimizers"][name]  # noqa: E731
                layer = _cells(chosen, lambda r: (
                    "(" + ", ".join(_log2(v) for v in of(r)["layer_scales"]) + ")"
                    if "layer_scales" in of(r) else "-"))
                lines.append(
                    f"| {pattern if i == 0 else ''} | {variant if i == 0 else ''} | {name} "
                    f"| {_cells(chosen, lambda r: str(of(r)['skipped']))} of {chosen[0]['steps']} "
                    f"| {_cells(chosen, lambda r: _log2(of(r)['scale']))} | {layer} "
                    f"| {distance if i == 0 else ''} | {losses if i == 0 else ''} |"
                )
    return "\n".join(lines)


# --- clone_model on instrumented models ------------------------------------


@keras.saving.register_keras_serializable(package="keras_io_patterns")
class RegisteredNet(keras.Model):
    def __init__(self, units=16, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.head = keras.layers.Dense(3)

    def call(self, x):
        return self.head(self.hidden(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


class UnregisteredNet(RegisteredNet):
    pass


def _clone_cases():
    def functional():
        inputs = keras.Input((8,))
        x = keras.layers.Dense(16, activation="relu")(inputs)
        return keras.Model(inputs, keras.layers.Dense(3)(x), name="net")

    def sequential():
        return keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
        )

    def subclassed(cls):
        def build():
            model = cls(units=16)
            model(np.zeros((2, 8), "float32"))
            return model
        return build

    def gpt2():
        import keras_hub

        return keras_hub.models.GPT2Backbone(
            vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=16,
            intermediate_dim=32, max_sequence_length=8,
        )

    return {
        "Functional": functional,
        "Sequential": sequential,
        "subclassed, registered": subclassed(RegisteredNet),
        "subclassed, not registered": subclassed(UnregisteredNet),
        "KerasHub GPT2Backbone (tiny)": gpt2,
    }


def clone_row(name, build):
    keras.backend.clear_session(free_memory=False)
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    original = tf_als.instrument(build())
    try:
        clone = keras.models.clone_model(original)
    except Exception as error:  # noqa: BLE001 - the table reports it
        message = " ".join(str(error).split()).replace("`", "'")
        return {"model": name, "error": f"{type(error).__name__}: {message[:160]}"}
    pairs = list(zip(original.weights, clone.weights))
    plain = keras.models.clone_model(original.uninstrumented())
    return {
        "plain_clone_class": type(plain).__name__,
        "model": name,
        "instrumented": isinstance(clone, tf_als.InstrumentedModel),
        "class": type(clone).__name__,
        "original_class": type(original.uninstrumented()).__name__,
        "weights_line_up": len(original.weights) == len(clone.weights)
        and all(tuple(w.shape) == tuple(c.shape) for w, c in pairs),
        "new_variables": all(w is not c for w, c in pairs),
        "weights": len(clone.weights),
    }


def clone_table(rows):
    lines = [
        "| model (instrumented) | clone_model returns | instrumented | class | weights line up "
        "(order, shape) | new variables | class of Keras's clone of the plain model |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | `{row['error']}` | - | - | - | - | - |")
            continue
        returns = "instrumented model" if row["instrumented"] else "plain model"
        lines.append(
            f"| {row['model']} | {returns} | {'yes' if row['instrumented'] else 'no'} "
            f"| {row['class']} | {'yes' if row['weights_line_up'] else 'no'} "
            f"({row['weights']} weights) | {'yes' if row['new_variables'] else 'no'} "
            f"| {row['plain_clone_class']} |"
        )
    return "\n".join(lines)


# --- output -------------------------------------------------------------------


def _commit():
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)), check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write(results, name):
    """Writes `results` (both sections, those not run kept from the last
    file) as JSON and Markdown."""
    path = os.path.join(RESULTS, name)
    with open(path + ".json", "w") as f:
        json.dump(results, f, indent=1)
    lines = ["Written by `python benchmarks/keras_io_patterns.py`", ""]
    patterns = results.get("patterns")
    if patterns:
        lines += [
            f"## The patterns ({patterns['date']}, commit {patterns['commit']}, "
            f"{patterns['machine']}, XLA {patterns['xla']})", "",
            patterns["settings"], "", pattern_table(patterns["runs"]), "",
            *_notes(patterns["runs"]),
            *[f"- DDIM, `{k}`: `{v}`" for k, v in patterns.get("wrapper", {}).items()],
            "",
        ]
    clones = results.get("clone_table")
    if clones:
        lines += [
            f"## `keras.models.clone_model` of an instrumented model ({clones['date']}, "
            f"commit {clones['commit']}, `--clone-table`)", "",
            clone_table(clones["rows"]), "",
        ]
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines))


def _notes(runs):
    """What the table cannot say, read from the runs."""
    checked = [r for r in runs if r["variant"] == "tf_als_preflight"]
    moved = [r for r in checked if r["preflight_moved_seed"]]
    notes = [
        "- `tf_als` is the documented set-up and nothing more. `fit`'s own "
        "first-batch check runs only for a model that is instrumented itself; "
        "here `fit` trains the wrapper (`DiffusionModel`, `ConditionalGAN`), "
        "which is not, so `tf_als` starts at S = 2**15 as Keras does.",
        f"- `preflight` advanced the wrapper's `SeedGenerator` (the step's noise) in "
        f"{len(moved)} of {len(checked)} `tf_als_preflight` runs; the benchmark put "
        "its state back before `fit`, so every variant drew the same noise.",
    ]
    ema = [r["ema_instrumented"] for r in runs if "ema_instrumented" in r and r["variant"].startswith("tf_als")]
    if ema:
        notes.append(
            f"- The DDIM's EMA network (`keras.models.clone_model` of the instrumented "
            f"network) came back instrumented in {sum(ema)} of {len(ema)} tf_als runs."
        )
    return notes


def _load(name):
    path = os.path.join(RESULTS, name + ".json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _stamp():
    return {"date": datetime.date.today().isoformat(), "commit": _commit(), "machine": MACHINE}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--clone-table", action="store_true")
    parser.add_argument("--patterns", default="ddim,cgan")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--xla", choices=("off", "on"), default="off")
    parser.add_argument("--ddim-batch", type=int, default=32)
    parser.add_argument("--ddim-steps-per-epoch", type=int, default=10)
    parser.add_argument("--ddim-epochs", type=int, default=4)
    parser.add_argument("--gan-batch", type=int, default=64)
    parser.add_argument("--gan-steps-per-epoch", type=int, default=14)
    parser.add_argument("--gan-epochs", type=int, default=3)
    parser.add_argument("--output", default="keras_io_patterns")
    args = parser.parse_args()
    results = _load(args.output)
    if args.clone_table:
        rows = [clone_row(name, build) for name, build in _clone_cases().items()]
        print(clone_table(rows))
        results["clone_table"] = {**_stamp(), "rows": rows}
        write(results, args.output)
        return
    trainers = {"ddim": ddim, "cgan": cgan}
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = []
    for name in args.patterns.split(","):
        runs += run_pattern(name, trainers[name], seeds, args)
    settings = (
        f"ddim: {args.ddim_epochs} epochs x {args.ddim_steps_per_epoch} steps of batch "
        f"{args.ddim_batch}; cgan: {args.gan_epochs} epochs x {args.gan_steps_per_epoch} "
        f"steps of batch {args.gan_batch}. Losses are the means over the last epoch; "
        "distance is ||w - w32|| / ||w32|| over the trainable weights."
    )
    wrapper = wrapper_check(seeds[0], args) if "ddim" in args.patterns else {}
    print()
    print(pattern_table(runs))
    print(wrapper)
    results["patterns"] = {
        **_stamp(), "xla": args.xla, "settings": settings, "runs": runs, "wrapper": wrapper,
    }
    write(results, args.output)


if __name__ == "__main__":
    main()
