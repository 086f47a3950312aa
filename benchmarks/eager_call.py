"""What an eager call of an instrumented model costs next to the plain
model's, measured side by side in one process.

A decode loop (keras.io's seq2seq greedy decode, a sampler's denoising
steps) calls the model eagerly, once per token or step, outside any
`fit`. `tf_als.instrument(model)` shares the model's layers and weights,
so the two are timed on the same weights and inputs: alternating rounds
of `--calls` calls each (the first call of each is left out), for
`training=False` (inference: decode loops, evaluation by hand) and
`training=True` outside a tape (a hand-written loop's forward pass).
Reported: the ratio of the medians, instrumented / plain, with a 90%
interval from 2000 bootstrap resamples of the per-call times.

    python benchmarks/eager_call.py
    python benchmarks/eager_call.py --models gpt2 --calls 50 --rounds 5
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import numpy as np  # noqa: E402

import overhead  # noqa: E402  (its models, built the same way)

MODELS = ("cnn", "gpt2")


def _times(model, x, training, calls):
    model(x, training=training)  # anything lazy happens here, untimed
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        model(x, training=training)
        times.append(time.perf_counter() - start)
    return times


def _ratio(numerator, denominator, resamples=2000, seed=0):
    rng = np.random.default_rng(seed)
    numerator, denominator = np.asarray(numerator), np.asarray(denominator)
    ratios = [
        np.median(rng.choice(numerator, numerator.size))
        / np.median(rng.choice(denominator, denominator.size))
        for _ in range(resamples)
    ]
    centre = np.median(numerator) / np.median(denominator)
    return centre, np.percentile(ratios, 5), np.percentile(ratios, 95)


def measure(name, calls, rounds):
    import keras

    import tf_als

    keras.mixed_precision.set_global_policy("mixed_float16")
    model, _, x, _, batch = overhead.build(name, blocks=3, batch=8)
    x = x[:batch] if not isinstance(x, dict) else {k: v[:batch] for k, v in x.items()}
    instrumented = tf_als.instrument(model)
    rows = []
    for training in (False, True):
        plain, scaled = [], []
        for _ in range(rounds):
            plain += _times(model, x, training, calls)
            scaled += _times(instrumented, x, training, calls)
        centre, low, high = _ratio(scaled, plain)
        rows.append((name, training, 1e3 * np.median(plain), centre, low, high))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    arguments = parser.parse_args()
    print("| model | training | plain call (ms) | instrumented / plain (90% interval) |")
    print("| --- | --- | ---: | --- |")
    for name in arguments.models.split(","):
        for model, training, plain_ms, centre, low, high in measure(
            name, arguments.calls, arguments.rounds
        ):
            print(
                f"| {model} | {training} | {plain_ms:.2f} | "
                f"{centre:.3f} ({low:.3f}-{high:.3f}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
