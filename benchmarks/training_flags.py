"""A base model called with `training=False` inside a model (keras.io's
transfer-learning recipe): how far the instrumented model's outputs are
from the plain model's under the outer flag `fit` uses (True) and under
False, and how far the recipe's fine-tuning moves the base's first kernel
under Keras's LossScaleOptimizer and under tf_als.

Keras 3.15 hands the outer call's flag to every node it runs, over the
one the node was built with (keras-team/keras#20285), so under `fit` the
base runs in training mode; the instrumented model must compute exactly
what the plain model computes, so every difference printed should be 0.

    python benchmarks/training_flags.py                        # ~2 min; results/training_flags.md
    PYTHONPATH=<an older checkout> python benchmarks/training_flags.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_als  # noqa: E402

layers = keras.layers
SHAPE = (64, 64, 3)


class Reads(layers.Layer):
    """Triples its input in training mode: the flag it got shows."""

    def call(self, x, training=None):
        return x * 3.0 if training else x


def conv_base():
    inputs = keras.Input(SHAPE)
    x = layers.BatchNormalization()(layers.Conv2D(8, 3)(inputs))
    return keras.Model(inputs, layers.Dropout(0.5)(x))


def mobilenet_base():
    return keras.applications.MobileNetV2(
        input_shape=SHAPE, include_top=False, weights=None
    )


def dense_base():
    inputs = keras.Input(SHAPE)
    return keras.Model(inputs, Reads()(layers.Dense(4)(inputs)))


BASES = {
    "Conv2D, BatchNormalization, Dropout": conv_base,
    "keras.applications MobileNetV2": mobilenet_base,
    "Dense, a layer that reads `training`": dense_base,
}


def with_head(base):
    inputs = keras.Input(SHAPE)
    x = layers.GlobalAveragePooling2D()(base(inputs, training=False))
    return keras.Model(inputs, layers.Dense(2, dtype="float32")(x))


def output_differences(build, x):
    """max |instrumented - plain| under outer training True, then False,
    each call from the same dropout seed state."""
    keras.utils.set_random_seed(0)
    model = with_head(build())
    instrumented = tf_als.instrument(model)
    seeds = [v for v in model.variables if "seed_generator" in v.path]
    start = [keras.ops.convert_to_numpy(v) for v in seeds]

    def run(m, training):
        for variable, value in zip(seeds, start):
            variable.assign(value)
        return np.asarray(m(x, training=training))

    return [
        float(np.max(np.abs(run(instrumented, t) - run(model, t))))
        for t in (True, False)
    ]


def fine_tuning(adaptive, x, y):
    """(max change of the base's first kernel, steps applied) over the
    recipe's second phase: the base unfrozen, recompiled, 4 steps."""
    keras.utils.set_random_seed(0)
    base = mobilenet_base()
    base.trainable = False
    model = with_head(base)
    if adaptive:
        model = tf_als.instrument(model)

    def optimizer():
        inner = keras.optimizers.Adam(1e-3)
        if adaptive:
            return tf_als.AdaptiveLossScaleOptimizer(inner)
        return keras.optimizers.LossScaleOptimizer(inner)

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer(), loss)
    model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    kernel = keras.ops.convert_to_numpy(base.layers[1].kernel)
    base.trainable = True
    model.compile(optimizer(), loss)
    model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    change = float(np.max(np.abs(keras.ops.convert_to_numpy(base.layers[1].kernel) - kernel)))
    applied = int(keras.ops.convert_to_numpy(model.optimizer.inner_optimizer.iterations))
    return change, applied


def main():
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 2.0, (8,) + SHAPE).astype("float32")
    print(f"tf_als {tf_als.__version__}, batch of 8 at {SHAPE[0]}x{SHAPE[1]}\n")
    print("| base, called with `training=False` | outer `training=True` | outer `training=False` |")
    print("| --- | ---: | ---: |")
    for name, build in BASES.items():
        on, off = output_differences(build, x)
        print(f"| {name} | {on:.3g} | {off:.3g} |", flush=True)
    xs = np.concatenate([x] * 4)
    ys = np.concatenate([rng.integers(0, 2, 8)] * 4)
    print("\n| fine-tuning, 4 steps | first kernel's max change | steps applied |")
    print("| --- | ---: | ---: |")
    for adaptive in (False, True):
        change, applied = fine_tuning(adaptive, xs, ys)
        name = "tf_als" if adaptive else "Keras LossScaleOptimizer"
        print(f"| {name} | {change:.4g} | {applied} of 4 |", flush=True)


if __name__ == "__main__":
    main()
