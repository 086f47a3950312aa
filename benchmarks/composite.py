"""Cost of opening composite layers, against Keras's LossScaleOptimizer.

For KerasHub GPT-2 and ViT backbones (tiny configs, random weights, a
classification head), side by side in one process: the number of scaling
points, `fit` set-up (the first call of the train function: trace and
compile) and the mean step time after it, for Keras's `LossScaleOptimizer`
and for tf_als (update_interval 100), XLA off.

    python benchmarks/composite.py [--steps 30]
"""

import argparse
import sys
import time
import warnings

import keras
import tensorflow as tf

sys.path.insert(0, ".")
import tf_als  # noqa: E402
from tests import architectures  # noqa: E402

CASES = {
    "gpt2": next(c for c in architectures.SAVE_CASES if c.name == "gpt2_classifier"),
    "vit": next(c for c in architectures.HUB_CASES if c.name == "vit"),
}


def _run(case, adaptive, steps):
    _, model = case.build_pair()
    x, y = case.data()
    if adaptive:
        model = tf_als.instrument(model)
        optimizer = tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-4))
    else:
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-4))
    model.compile(optimizer=optimizer, loss=case.loss, jit_compile=False)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(len(y)).repeat()
    start = time.perf_counter()
    model.fit(data, steps_per_epoch=1, epochs=1, verbose=0)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0)
    step = (time.perf_counter() - start) / steps
    points = len(model.scaling_points) if adaptive else 0
    return points, setup, step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    keras.mixed_precision.set_global_policy("mixed_float16")
    warnings.simplefilter("ignore")
    print("| model | points | set-up keras (s) | set-up tf_als (s) | ratio | step keras (ms) | step tf_als (ms) | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, case in CASES.items():
        _, keras_setup, keras_step = _run(case, False, args.steps)
        points, als_setup, als_step = _run(case, True, args.steps)
        print(
            f"| {name} | {points} | {keras_setup:.2f} | {als_setup:.2f} | "
            f"{als_setup / keras_setup:.2f} | {1e3 * keras_step:.1f} | "
            f"{1e3 * als_step:.1f} | {als_step / keras_step:.2f} |"
        )


if __name__ == "__main__":
    main()
