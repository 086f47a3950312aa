"""The training-loop patterns of keras.io's guides and examples, at toy size,
written the way their users write them: a model with its own `train_step`,
a GAN (DCGAN's losses, or WGAN-GP's with its gradient penalty), a VAE and a
distiller. Each step calls `optimizer.scale_loss` inside its tape and
`optimizer.apply` after it, as a `LossScaleOptimizer` needs; with a plain
optimizer (the float32 reference) `scale_loss` returns the loss as it is,
so the same code trains all the variants the tests compare.

Data are numbers fed through `fit` as a dict, so every variant sees the
same batches and the same latent noise.
"""

import keras
import numpy as np
import tensorflow as tf

from tests import failure_cases

LATENT = 4
FEATURES = 8


def data(count=64, seed=0) -> dict:
    """Real samples (a shifted, stretched Gaussian in FEATURES dimensions)
    and two latent draws per sample."""
    rng = np.random.default_rng(seed)
    real = rng.normal(0.0, 1.0, (count, FEATURES)) * np.linspace(0.5, 2.0, FEATURES)
    real = real + np.linspace(-1.0, 3.0, FEATURES)
    return {
        "real": real.astype("float32"),
        "z1": rng.normal(size=(count, LATENT)).astype("float32"),
        "z2": rng.normal(size=(count, LATENT)).astype("float32"),
    }


def mlp(inputs, width, outputs, name, activation="relu", seed=0):
    """Dense layers in the global policy, a float32 output layer."""
    keras.utils.set_random_seed(seed)
    x = inp = keras.Input((inputs,))
    x = keras.layers.Dense(width, activation=activation)(x)
    x = keras.layers.Dense(width, activation=activation)(x)
    out = keras.layers.Dense(outputs, dtype="float32")(x)
    return keras.Model(inp, out, name=name)


@keras.saving.register_keras_serializable(package="tests")
class Block(keras.layers.Layer):
    """A composite layer: two Dense sublayers and a residual sum in its own
    `call` (its sublayers are inner scaling points)."""

    def __init__(self, width, activation="relu", **kwargs):
        super().__init__(**kwargs)
        self.width, self.activation = width, activation
        self.inner = keras.layers.Dense(width, activation=activation)
        self.outer = keras.layers.Dense(width, activation=activation)

    def call(self, x):
        return x + self.outer(self.inner(x))

    def get_config(self):
        return {**super().get_config(), "width": self.width, "activation": self.activation}


def composite_mlp(inputs, width, outputs, name, activation="relu", seed=0):
    """`mlp` with a `Block` between its first layer and its output layer."""
    keras.utils.set_random_seed(seed)
    x = inp = keras.Input((inputs,))
    x = keras.layers.Dense(width, activation=activation)(x)
    x = Block(width, activation)(x)
    out = keras.layers.Dense(outputs, dtype="float32")(x)
    return keras.Model(inp, out, name=name)


IMAGE = 16


def images(count=256, seed=0) -> dict:
    """Real IMAGExIMAGE one-channel images (a bright disc of random centre
    and radius on a dark background) and two latent draws per image."""
    rng = np.random.default_rng(seed)
    grid = np.arange(IMAGE)[None, :, None]
    centre = rng.uniform(4, IMAGE - 4, (count, 2, 1, 1))
    radius = rng.uniform(2, 5, (count, 1, 1))
    distance = (grid - centre[:, 0]) ** 2 + (np.transpose(grid, (0, 2, 1)) - centre[:, 1]) ** 2
    real = np.tanh(2.0 * (radius**2 - distance) / radius**2)[..., None]
    return {
        "real": real.astype("float32"),
        "z1": rng.normal(size=(count, LATENT)).astype("float32"),
        "z2": rng.normal(size=(count, LATENT)).astype("float32"),
    }


def conv_generator(seed=0):
    """DCGAN's generator at toy size: Dense, reshape, two transposed
    convolutions, a float32 tanh output."""
    keras.utils.set_random_seed(seed)
    z = keras.Input((LATENT,))
    x = keras.layers.Dense(4 * 4 * 32, activation="relu")(z)
    x = keras.layers.Reshape((4, 4, 32))(x)
    x = keras.layers.Conv2DTranspose(32, 4, strides=2, padding="same", activation="relu")(x)
    x = keras.layers.Conv2DTranspose(16, 4, strides=2, padding="same", activation="relu")(x)
    out = keras.layers.Conv2D(1, 3, padding="same", activation="tanh", dtype="float32")(x)
    return keras.Model(z, out, name="conv_gen")


def conv_critic(seed=0):
    """DCGAN's critic at toy size: two strided convolutions with leaky
    ReLU, a float32 linear score."""
    keras.utils.set_random_seed(seed)
    image = keras.Input((IMAGE, IMAGE, 1))
    x = keras.layers.Conv2D(32, 4, strides=2, padding="same")(image)
    x = keras.layers.LeakyReLU(0.2)(x)
    x = keras.layers.Conv2D(64, 4, strides=2, padding="same")(x)
    x = keras.layers.LeakyReLU(0.2)(x)
    x = keras.layers.Flatten()(x)
    out = keras.layers.Dense(1, dtype="float32")(x)
    return keras.Model(image, out, name="conv_critic")


def pixel_images(count=96, seed=0) -> dict:
    """`images` as pixel values in [0, 255], not rescaled to [-1, 1]: the
    step keras.io's DCGAN takes and users skip."""
    data = images(count, seed)
    data["real"] = 127.5 + 127.5 * data["real"]
    return data


def pixel_generator(seed=0):
    """A generator of pixel values: a Dense net, a float32 linear output
    around 127.5."""
    keras.utils.set_random_seed(seed)
    z = keras.Input((LATENT,))
    x = keras.layers.Dense(64, activation="relu")(z)
    x = keras.layers.Dense(IMAGE * IMAGE, dtype="float32")(x)
    x = keras.layers.Rescaling(64.0, offset=127.5, dtype="float32")(x)
    x = keras.layers.Reshape((IMAGE, IMAGE, 1), dtype="float32")(x)
    return keras.Model(z, x, name="pixel_gen")


def normalised_critic(seed=0):
    """A critic with a hand-written instance normalisation after its
    convolution, a float32 linear score."""
    keras.utils.set_random_seed(seed)
    image = keras.Input((IMAGE, IMAGE, 1))
    x = keras.layers.Conv2D(16, 3, padding="same")(image)
    # Instance normalisation written by hand in the compute dtype (WGAN-GP's
    # critic avoids batch normalisation): on float16 maps of pixel-scale
    # activations its mean of squares overflows, and it outputs zeros.
    x = failure_cases.HandInstanceNorm(name="norm")(x)
    x = keras.layers.LeakyReLU(0.2)(x)
    x = keras.layers.Flatten()(x)
    out = keras.layers.Dense(1, dtype="float32")(x)
    return keras.Model(image, out, name="normalised_critic")


class CountingModel(keras.Model):
    """keras.io "Customizing what happens in fit()": a subclassed model with
    its own `train_step`, which also counts the batches it ran."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.head = keras.layers.Dense(1, dtype="float32")
        self.steps_run = keras.Variable(0, dtype="int32", trainable=False)

    def call(self, x):
        return self.head(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            scaled = self.optimizer.scale_loss(loss)
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(scaled, variables), variables)
        self.steps_run.assign_add(1)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def predict_twice(self, x):
        """A method of the user's class that calls the model."""
        return self(x) * 2.0


class GAN(keras.Model):
    """keras.io's DCGAN and WGAN-GP training steps: the critic's step (the
    generator called inside its tape), then the generator's step through
    the critic. `penalty` > 0 gives WGAN-GP's losses and gradient penalty;
    0 gives DCGAN's cross-entropies."""

    def __init__(
        self, generator, critic, penalty=0.0, critic_steps=1, scale_penalty=False, **kwargs
    ):
        super().__init__(**kwargs)
        self.generator = generator
        self.critic = critic
        self.penalty = penalty
        self.critic_steps = critic_steps
        self.scale_penalty = scale_penalty

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def critic_loss(self, real, z):
        fake = self.generator(z, training=True)
        real_score = self.critic(real, training=True)
        fake_score = self.critic(fake, training=True)
        if not self.penalty:
            return _cross_entropy(1.0, real_score) + _cross_entropy(0.0, fake_score)
        loss = tf.reduce_mean(fake_score) - tf.reduce_mean(real_score)
        return loss + self.penalty * self.gradient_penalty(real, fake)

    def gradient_penalty(self, real, fake):
        alpha = tf.linspace(0.0, 1.0, tf.shape(real)[0])
        alpha = tf.reshape(alpha, [-1] + [1] * (len(real.shape) - 1))
        mixed = real + alpha * (tf.cast(fake, real.dtype) - real)
        with tf.GradientTape() as tape:
            tape.watch(mixed)
            score = self.critic(mixed, training=True)
            if self.scale_penalty:
                score = self.d_optimizer.scale_loss(score)
        gradient = tape.gradient(score, mixed)
        if self.scale_penalty:
            # PyTorch's recipe for penalties under loss scaling: take the
            # inner gradient of the scaled score, unscale it before use.
            scale = self.d_optimizer.scale_loss(tf.constant(1.0))
            gradient = gradient / tf.cast(scale, gradient.dtype)
        squares = tf.reduce_sum(tf.reshape(tf.square(gradient), [tf.shape(gradient)[0], -1]), axis=1)
        norm = tf.sqrt(squares + 1e-12)
        return tf.reduce_mean(tf.square(norm - 1.0))

    def generator_loss(self, z):
        score = self.critic(self.generator(z, training=True), training=True)
        if not self.penalty:
            return _cross_entropy(1.0, score)
        return -tf.reduce_mean(score)

    def train_step(self, data):
        real, z1, z2 = data["real"], data["z1"], data["z2"]
        # Under tf.distribute each replica's loss is a mean over its share
        # of the batch, and the optimizer sums the replicas' gradients (as
        # TensorFlow's custom-training guide says, divide by the replicas).
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        for _ in range(self.critic_steps):
            with tf.GradientTape() as tape:
                d_loss = self.critic_loss(real, z1)
                scaled = self.d_optimizer.scale_loss(d_loss / replicas)
            variables = self.critic.trainable_weights
            self.d_optimizer.apply(tape.gradient(scaled, variables), variables)
        with tf.GradientTape() as tape:
            g_loss = self.generator_loss(z2)
            scaled = self.g_optimizer.scale_loss(g_loss / replicas)
        variables = self.generator.trainable_weights
        self.g_optimizer.apply(tape.gradient(scaled, variables), variables)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {m.name: m.result() for m in self.metrics}


def _cross_entropy(label, logits):
    logits = tf.cast(logits, tf.float32)
    labels = tf.fill(tf.shape(logits), label)
    return tf.reduce_mean(
        tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
    )


def sample_error(generator, data_) -> float:
    """How far the generator's samples are from the real ones: the mean over
    features of |mean difference| + |std difference|, on the latent draws
    of `data_` (0 for a perfect match of the first two moments)."""
    fake = np.asarray(generator(data_["z1"], training=False), np.float64)
    real = data_["real"].astype(np.float64)
    return float(
        np.mean(np.abs(fake.mean(0) - real.mean(0)) + np.abs(fake.std(0) - real.std(0)))
    )


class VAE(keras.Model):
    """keras.io's VAE step: one optimizer over the encoder and the decoder,
    the reparameterised sample drawn from fixed noise in the batch."""

    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.loss_tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.loss_tracker]

    def loss_of(self, x, noise):
        moments = tf.cast(self.encoder(x, training=True), tf.float32)
        mean, log_var = moments[:, :LATENT], moments[:, LATENT:]
        z = mean + tf.exp(0.5 * log_var) * noise
        reconstruction = tf.cast(self.decoder(z, training=True), tf.float32)
        error = tf.reduce_mean(tf.reduce_sum(tf.square(x - reconstruction), axis=1))
        kl = -0.5 * tf.reduce_mean(
            tf.reduce_sum(1 + log_var - tf.square(mean) - tf.exp(log_var), axis=1)
        )
        return error + kl

    def train_step(self, data):
        with tf.GradientTape() as tape:
            loss = self.loss_of(data["real"], data["z1"])
            scaled = self.optimizer.scale_loss(loss)
        variables = self.encoder.trainable_weights + self.decoder.trainable_weights
        self.optimizer.apply(tape.gradient(scaled, variables), variables)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}


class Distiller(keras.Model):
    """keras.io's knowledge distillation step: a frozen teacher, a student
    trained on the labels and on the teacher's softened outputs."""

    def __init__(self, student, teacher, temperature=3.0, alpha=0.5, **kwargs):
        super().__init__(**kwargs)
        self.student = student
        self.teacher = teacher
        self.temperature = temperature
        self.alpha = alpha
        self.loss_tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.loss_tracker]

    def train_step(self, data):
        x, y = data["real"], data["label"]
        teacher = tf.cast(self.teacher(x, training=False), tf.float32)
        with tf.GradientTape() as tape:
            student = tf.cast(self.student(x, training=True), tf.float32)
            hard = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(y, student, from_logits=True)
            )
            soft = keras.losses.KLDivergence()(
                tf.nn.softmax(teacher / self.temperature),
                tf.nn.softmax(student / self.temperature),
            )
            loss = self.alpha * hard + (1 - self.alpha) * soft * self.temperature**2
            scaled = self.optimizer.scale_loss(loss)
        variables = self.student.trainable_weights
        self.optimizer.apply(tape.gradient(scaled, variables), variables)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}
