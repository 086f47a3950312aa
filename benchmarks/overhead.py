"""Step time and peak memory of tf_als against Keras's LossScaleOptimizer.

Trains the same residual CNN (synthetic 16x16 images, mixed_float16, SGD)
with `keras.optimizers.LossScaleOptimizer` and with
`tf_als.AdaptiveLossScaleOptimizer` at update_interval 1, 10 and 100, with
XLA off and on, and prints each variant's mean step time and its ratio to
Keras's in the same mode.

Timing: all variants of one mode live in one process and train in
alternating chunks of `--chunk` steps (a multiple of 100, so every chunk of
every variant holds the same number of scale updates), after a warm-up
that compiles them (and runs the first scale update). A chunk's time is
the wall time from the end of its first batch to the end of its last (fit's
set-up and tear-down, several seconds per call and the same for every
variant, and a possible retrace in the first batch are left out); a
variant's step time is the total over `--rounds` chunks divided by the
steps timed (each chunk's update step is among them).

"update +ms" is how much longer a tf_als scale-update step takes on average
than Keras's median step, and "from updates" the ratio that cost alone
implies at the variant's interval, 1 + update_ms / (interval * keras_ms).
Steps without an update cost the same with and without tf_als, so on a busy
machine, where whole chunks drift by more than the overhead, that column
is the steadier estimate.

Memory: each variant trains in a fresh subprocess; a thread samples the
process's resident set size every 2 ms during the timed steps (after
compilation), and the peak is reported, with its ratio to Keras's. The
TensorFlow runtime itself is most of that number; the ratio is what a
user's process sees, not the ratio of tensor memory alone.

    python benchmarks/overhead.py            # full run (~30 min on 2 quiet cores)
    python benchmarks/overhead.py --quick    # XLA off, one round (~10 min)
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


class StepTimer:
    """Times the steps of one `fit` call: the wall time from the first
    batch's start to the last batch's end (fit's own set-up and tear-down,
    the same for every variant and noisy, are left out), and each step's
    duration with whether it was a scale-update step."""

    def __init__(self, keras, interval):
        timer = self

        class Callback(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                step = int(self.model.optimizer.iterations.numpy())
                timer.updates.append(interval > 0 and step % interval == 0)
                timer.starts.append(time.perf_counter())

            def on_train_batch_end(self, batch, logs=None):
                timer.ends.append(time.perf_counter())

        self.callback = Callback()
        self.starts, self.ends, self.updates = [], [], []

    @property
    def seconds(self):
        """From the end of the first batch to the end of the last: the first
        batch of a `fit` call may retrace the train function."""
        return self.ends[-1] - self.ends[0]

    @property
    def steps(self):
        return len(self.ends) - 1

    def step_seconds(self, update):
        return [
            end - start
            for start, end, is_update in zip(self.starts, self.ends, self.updates)
            if is_update == update
        ]


def interval_of(variant):
    return 0 if variant == "keras" else int(variant.split("_")[1])


def train(model, x, y, batch, variant):
    import keras

    timer = StepTimer(keras, interval_of(variant))
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
              callbacks=[timer.callback])
    return timer


def time_mode(jit_compile, args):
    """Mean seconds per step of each variant, and how much longer its
    update steps take on average than Keras's median step."""
    import numpy as np

    models = {v: make(v, jit_compile) for v in VARIANTS}
    x, y = data(args.batch, args.chunk)
    for variant, model in models.items():  # compile; the first update runs
        train(model, x[: 2 * args.batch], y[: 2 * args.batch], args.batch,
              variant)
    timers = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant, model in models.items():
            timers[variant].append(train(model, x, y, args.batch, variant))
    plain = np.median([s for t in timers["keras"] for s in t.step_seconds(False)])
    times, extra = {}, {}
    for variant, runs in timers.items():
        times[variant] = sum(t.seconds for t in runs) / sum(t.steps for t in runs)
        updates = [s for t in runs for s in t.step_seconds(True)]
        extra[variant] = float(np.mean(updates) - plain) if updates else 0.0
    return times, extra


def peak_memory(variant, jit_compile, args):
    """Runs in a subprocess: peak RSS (MiB) while training `--chunk` steps."""
    model = make(variant, jit_compile)
    x, y = data(args.batch, args.chunk)
    train(model, x[: 2 * args.batch], y[: 2 * args.batch], args.batch, variant)
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
    train(model, x, y, args.batch, variant)
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
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak-memory subprocesses")
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
        times, extra = time_mode(jit, args)
        memory = {v: float("nan") for v in VARIANTS}
        for variant in () if args.no_memory else VARIANTS:
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
                times[variant] / times["keras"], extra[variant] * 1000,
                1 + extra[variant] / (max(interval_of(variant), 1) * times["keras"]),
                memory[variant], memory[variant] / memory["keras"],
            ))
    print(f"\nResidual CNN, batch {args.batch}, 16x16x3, mixed_float16, "
          f"{args.rounds} x {args.chunk} timed steps per variant")
    print(f"{'XLA':>4} {'variant':>10} {'ms/step':>9} {'time ratio':>11} "
          f"{'update +ms':>11} {'from updates':>13} {'peak MiB':>9} "
          f"{'mem ratio':>10}")
    for xla, variant, ms, ratio, extra_ms, estimate, mib, mratio in rows:
        name = "keras LSO" if variant == "keras" else "tf_als " + variant[4:]
        print(f"{xla:>4} {name:>10} {ms:9.1f} {ratio:11.3f} {extra_ms:11.0f} "
              f"{estimate:13.3f} {mib:9.0f} {mratio:10.3f}")


if __name__ == "__main__":
    main()
