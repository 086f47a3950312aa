"""Step time and peak memory of tf_als against Keras's LossScaleOptimizer.

Trains the same residual CNN (synthetic 16x16 images, mixed_float16, SGD)
with `keras.optimizers.LossScaleOptimizer` and with
`tf_als.AdaptiveLossScaleOptimizer` at update_interval 1, 10 and 100, with
XLA off and on, and prints each variant's mean step time and its ratio to
Keras's in the same mode.

Timing: all variants of one mode live in one process and train in
alternating chunks of `--chunk` steps (a multiple of 100, so every chunk of
every variant holds the same number of scale updates), after a warm-up
that compiles them; a step's time is the chunk's wall time divided by its
steps, and each variant's time is the mean over `--rounds` chunks.

Memory: each variant trains in a fresh subprocess; a thread samples the
process's resident set size every 2 ms during the timed steps (after
compilation), and the peak is reported, with its ratio to Keras's. The
TensorFlow runtime itself is most of that number, so the ratio is an upper
bound on nothing but what a user's machine sees.

    python benchmarks/overhead.py            # full run (~15 min on 2 cores)
    python benchmarks/overhead.py --quick    # smoke run (~3 min)
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

VARIANTS = ("keras", "als_1", "als_10", "als_100")


def build_model(keras):
    layers = keras.layers
    inputs = keras.Input((16, 16, 3))
    x = layers.Conv2D(32, 3, padding="same", use_bias=False)(inputs)
    for filters in (32, 32, 64, 64):
        y = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        y = layers.BatchNormalization()(y)
        y = layers.ReLU()(y)
        y = layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
        y = layers.BatchNormalization()(y)
        if x.shape[-1] != filters:
            x = layers.Conv2D(filters, 1, use_bias=False)(x)
        x = layers.ReLU()(layers.Add()([x, y]))
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(10, dtype="float32")(x)
    return keras.Model(inputs, outputs)


def make(variant, jit_compile):
    import keras

    import tf_als

    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = build_model(keras)
    inner = keras.optimizers.SGD(0.01)
    if variant == "keras":
        optimizer = keras.optimizers.LossScaleOptimizer(inner)
    else:
        model = tf_als.instrument(model)
        interval = int(variant.split("_")[1])
        optimizer = tf_als.AdaptiveLossScaleOptimizer(
            inner, update_interval=interval
        )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


def data(batch, steps):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 10, size=(batch * steps,))
    return x, y


def train(model, x, y, batch):
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    return time.perf_counter() - start


def time_mode(jit_compile, args):
    models = {v: make(v, jit_compile) for v in VARIANTS}
    x, y = data(args.batch, args.chunk)
    for model in models.values():  # compile
        train(model, x[: 2 * args.batch], y[: 2 * args.batch], args.batch)
    times = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant, model in models.items():
            seconds = train(model, x, y, args.batch)
            times[variant].append(seconds / args.chunk)
    return {v: sum(t) / len(t) for v, t in times.items()}


def peak_memory(variant, jit_compile, args):
    """Runs in a subprocess: peak RSS (MiB) while training `--chunk` steps."""
    model = make(variant, jit_compile)
    x, y = data(args.batch, args.chunk)
    train(model, x[: 2 * args.batch], y[: 2 * args.batch], args.batch)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        peak[0] = max(peak[0], int(line.split()[1]))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    train(model, x, y, args.batch)
    done.set()
    sampler.join()
    return peak[0] / 1024.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=100,
                        help="steps per timed chunk (a multiple of 100)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed chunks per variant")
    parser.add_argument("--quick", action="store_true",
                        help="one round, XLA off only")
    parser.add_argument("--memory-of", nargs=2, metavar=("VARIANT", "JIT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_of:
        variant, jit = args.memory_of
        print(json.dumps(peak_memory(variant, jit == "1", args)))
        return
    if args.chunk % 100:
        parser.error(f"--chunk must be a multiple of 100; got {args.chunk}")
    if args.quick:
        args.rounds = 1
    modes = (False,) if args.quick else (False, True)

    rows = []
    for jit in modes:
        times = time_mode(jit, args)
        memory = {}
        for variant in VARIANTS:
            out = subprocess.run(
                [sys.executable, __file__, "--memory-of", variant,
                 "1" if jit else "0", "--batch", str(args.batch),
                 "--chunk", str(args.chunk)],
                check=True, capture_output=True, text=True,
            )
            memory[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        for variant in VARIANTS:
            rows.append((
                "on" if jit else "off", variant, times[variant] * 1000,
                times[variant] / times["keras"], memory[variant],
                memory[variant] / memory["keras"],
            ))
    print(f"\nResidual CNN, batch {args.batch}, 16x16x3, mixed_float16, "
          f"{args.rounds} x {args.chunk} timed steps per variant")
    print(f"{'XLA':>4} {'variant':>10} {'ms/step':>9} {'time ratio':>11} "
          f"{'peak MiB':>9} {'mem ratio':>10}")
    for xla, variant, ms, ratio, mib, mratio in rows:
        name = "keras LSO" if variant == "keras" else "tf_als " + variant[4:]
        print(f"{xla:>4} {name:>10} {ms:9.1f} {ratio:11.3f} {mib:9.0f} "
              f"{mratio:10.3f}")


if __name__ == "__main__":
    main()
