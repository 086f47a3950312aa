"""How long `tf_als.diagnose` takes on keras.applications models at 32x32.

Each model (random weights, `weights=None`, 10 classes, input 32x32x3) is
built once under `mixed_float16`; `diagnose` then runs on one batch of 8
(`training=False`, sparse categorical cross-entropy from logits) `--calls`
times. The first call is reported on its own ("first": it includes any
one-off cost); the later calls ("repeat") are averaged. Each call is timed
in process time (CPU seconds of this process, all threads: on 2 cores it
can exceed wall time) and in wall time. The policy is set back to
"float32" at the end.

    python benchmarks/diagnose_time.py                     # ~2-6 min on 2 CPU cores
    python benchmarks/diagnose_time.py --models MobileNetV3Small --calls 2
    python benchmarks/diagnose_time.py --profile EfficientNetV2B0   # cProfile, cumulative
"""

import argparse
import cProfile
import os
import pstats
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_als  # noqa: E402

MODELS = ("MobileNetV3Small", "EfficientNetV2B0", "ConvNeXtTiny")
BATCH = 8
SIZE = 32
CLASSES = 10


def build(name):
    keras.utils.set_random_seed(0)
    return getattr(keras.applications, name)(
        weights=None, include_top=True, classes=CLASSES,
        input_shape=(SIZE, SIZE, 3), classifier_activation=None,
        include_preprocessing=False,
    )


def batch():
    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 1.0, (BATCH, SIZE, SIZE, 3)).astype("float32")
    y = rng.integers(0, CLASSES, (BATCH,))
    return x, y


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def timed(model, x, y):
    """(process seconds, wall seconds, report) of one `diagnose` call."""
    cpu, wall = time.process_time(), time.perf_counter()
    report = tf_als.diagnose(model, x, y, loss=loss(), training=False, verbose=False)
    return time.process_time() - cpu, time.perf_counter() - wall, report


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--calls", type=int, default=2,
                        help="diagnose calls per model (first reported apart)")
    parser.add_argument("--profile", choices=MODELS,
                        help="profile one repeat call of this model instead")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()

    x, y = batch()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        if args.profile:
            model = build(args.profile)
            timed(model, x, y)
            profiler = cProfile.Profile()
            profiler.enable()
            timed(model, x, y)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.top)
            return
        rows = []
        for name in args.models:
            model = build(name)
            runs = [timed(model, x, y) for _ in range(max(args.calls, 1))]
            report = runs[0][2]
            rest = runs[1:] or runs
            rows.append((
                name, len(model.layers), len(report.rows),
                runs[0][0], runs[0][1],
                sum(r[0] for r in rest) / len(rest),
                sum(r[1] for r in rest) / len(rest),
                report.keras_loss_scale, report.als_loss_scale,
            ))
            print(f"{name}: done", flush=True)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    print(
        "\n| model | layers | rows | first cpu s | first wall s "
        "| repeat cpu s | repeat wall s | keras scale | tf_als scale |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, layers, n, c0, w0, c, w, ks, als in rows:
        print(
            f"| {name} | {layers} | {n} | {c0:.1f} | {w0:.1f} | {c:.1f} "
            f"| {w:.1f} | {ks} | {als} |"
        )


if __name__ == "__main__":
    main()
