"""What tf_als costs next to Keras's LossScaleOptimizer, measured side by side.

For each model (a residual CNN, keras.applications ResNet50 at 32x32 and a
KerasHub GPT-2 with a tiny config; `--models` adds `densenet121`
(keras.applications, 32x32), `gpt2_mid`, a 4-layer
GPT-2 of hidden size 256 on 128 tokens, `bert_base`, a KerasHub BERT of
BERT-base's shape (12 layers, hidden size 768) on 32 tokens, and `unet`, a
4-level U-Net at 64x64 with a sigmoid output), with XLA off and on, one process
(`--worker`) builds three variants from the same weights and trains them
with `fit` on the same synthetic batches:

- `keras`: `keras.optimizers.LossScaleOptimizer`;
- `tf_als`: `tf_als.AdaptiveLossScaleOptimizer` with `telemetry_interval`
  equal to the chunk length, so every timed chunk holds exactly one
  telemetry step (since 0.3 every step chooses the scales, in the backward
  pass; the telemetry step also tallies the statistics, in `apply`'s one
  branch; in 0.2 these were `update_interval` and scale-update steps);
- `tf_als_1`: telemetry_interval 1 (statistics on every step).

The variants train in alternating chunks of `--chunk`
steps for `--rounds` rounds; a callback times every step but the first of
each chunk (which also sets up `fit`'s iterator); each chunk's update step
falls in its middle. Reported, as
ratios to Keras's median step:

- between updates: tf_als's median step without telemetry (an "update");
- update step: how much longer tf_als's median telemetry step takes than
  its median step without one, in units of the latter (the first such step
  a process runs in a compiled function without XLA also instantiates the
  statistics functions, an outlier the median leaves out);
- its spread: a 90% interval of that ratio, from 2000 bootstrap resamples
  of both variants' timed steps (a row whose interval is wider than 3% did
  not have the rounds to resolve the goal);
- interval 1: tf_als_1's median step (measured);
- interval 10 and 100: (between + update extra / interval), implied by the
  two measured numbers above;
- set-up: the first `fit` call (one step: trace, compile, run), in a fresh
  process per variant (in the timing process, whichever variant runs first
  would also pay the process's one-time costs), without tf_als's
  first-batch check, which that call also runs once (before 2026-12-03
  the column included it);
- first-batch check: that check's own time, once, in Keras steps (its
  median step between updates);
- peak memory: the process's resident set size sampled every 2 ms during
  `--chunk` steps, in the same fresh processes (`--no-memory` leaves it
  out of the table; most of it is the TensorFlow runtime, so this is what a
  user's process sees); and the resident set after the run once glibc's
  `malloc_trim(0)` has returned the heap's free pages (memory after trim:
  what is live, without what set-up allocated, freed and the allocator
  kept).

The timing is repeated under `tf.distribute.MirroredStrategy` over two
logical CPU devices (XLA off; not for ResNet50, whose steps take seconds
here), and a sweep shows how the cost grows with the number of scaling
points (the residual CNN at 1, 4, 16 and 64 blocks, XLA on).
Results go to `benchmarks/results/overhead.json` and `overhead.md`.

    python benchmarks/overhead.py                      # everything
    python benchmarks/overhead.py --models gpt2 --xla on --no-mirrored --no-sweep
"""

import argparse
import json
import os

import subprocess
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
MODELS = ("cnn", "resnet50", "gpt2")
# (batch, chunk, rounds) per model and XLA mode. Without XLA, TensorFlow's
# float16 convolution gradients have no fast CPU kernel: a step of the CNN
# at batch 32 takes 8.8 s there against 0.10 s with XLA, so the conv nets
# run small batches and few steps without XLA.
SETTINGS = {
    ("cnn", "off"): (8, 10, 2),
    ("cnn", "on"): (32, 20, 3),
    ("resnet50", "off"): (4, 10, 1),
    ("resnet50", "on"): (4, 20, 3),
    ("densenet121", "off"): (4, 10, 1),
    ("densenet121", "on"): (4, 20, 3),
    ("gpt2", "off"): (None, 20, 3),
    ("gpt2", "on"): (None, 20, 3),
    ("gpt2_mid", "off"): (8, 10, 3),
    ("gpt2_mid", "on"): (8, 10, 3),
    ("bert_base", "off"): (4, 6, 2),
    ("bert_base", "on"): (4, 6, 2),
    ("unet", "off"): (4, 10, 3),
    ("unet", "on"): (8, 10, 3),
}
# keras.applications models, at 32x32. DenseNet121's 242 weight-owning
# layers have 70 distinct output shapes (its dense blocks' inputs grow by 32
# channels a layer): what costs set-up wherever something is compiled per
# shape.
APPLICATIONS = {"resnet50": "ResNet50", "densenet121": "DenseNet121"}
# A BERT-base-shaped encoder (12 layers, hidden size 768, 12 heads) at a
# short sequence: the number and size of its points are BERT-base's, the
# vocabulary is small so that the embedding does not dominate memory.
BERT_BASE = dict(
    vocabulary_size=2000, num_layers=12, num_heads=12, hidden_dim=768,
    intermediate_dim=3072, max_sequence_length=32,
)
# The U-Net's input size (a 4-level U-Net, as in issue 39's report, made
# small enough for this CPU).
UNET_SIZE = 64
# A mid-size GPT-2 (4 layers, hidden size 256, 128 tokens): tf_als's cost
# per point is fixed, so its share of a step falls as the layers grow.
GPT2_MID = dict(
    vocabulary_size=5000, num_layers=4, num_heads=4, hidden_dim=256,
    intermediate_dim=1024, max_sequence_length=128,
)
# GPT-2 is left out: under MirroredStrategy on this machine Keras's own
# LossScaleOptimizer applies one replica's inf gradient and its weights turn
# inf (benchmarks/mirrored_gpt2.py), so Keras's side would time a broken run.
MIRRORED = ("cnn",)
# The residual CNN's blocks in the sweep of cost against points (two
# convolutions and two BatchNormalizations a block: 7 to 259 points).
SWEEP = (1, 4, 16, 64)
VARIANTS = ("keras", "tf_als", "tf_als_1")


# -- models -------------------------------------------------------------------


def residual_cnn(keras, blocks=4):
    """A residual CNN on 16x16x3 images (README's): a stem, `blocks`
    residual blocks (two 3x3 convolutions with BatchNormalization each), a
    dense head."""
    layers = keras.layers
    inputs = keras.Input((16, 16, 3))
    x = layers.Conv2D(32, 3, padding="same", use_bias=False)(inputs)
    for block in range(blocks):
        filters = 32 if block < blocks // 2 else 64
        y = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        y = layers.ReLU()(layers.BatchNormalization()(y))
        y = layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
        y = layers.BatchNormalization()(y)
        if x.shape[-1] != filters:
            x = layers.Conv2D(filters, 1, use_bias=False)(x)
        x = layers.ReLU()(layers.Add()([x, y]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(10, dtype="float32")(x))


def unet(keras, size=UNET_SIZE, levels=4, width=8):
    """`tests/architectures.py`'s U-Net."""
    from tests import architectures

    return architectures.unet(size, levels, width)


def _token_classifier(keras, backbone, pooled, config, batch, rng, loss):
    """(model, loss, x, y, batch size): a float32 10-class head on a
    KerasHub backbone's `pooled` output, and a batch of random tokens for
    every input the backbone takes (segment ids 0, no padding)."""
    import numpy as np

    model = keras.Model(backbone.input, keras.layers.Dense(10, dtype="float32")(pooled))
    shape = (batch, config["max_sequence_length"])
    x = {name: np.zeros(shape, "int32") for name in backbone.input}
    x["token_ids"] = rng.integers(0, config["vocabulary_size"], size=shape).astype("int32")
    x["padding_mask"] = np.ones(shape, "int32")
    return model, loss, x, rng.integers(0, 10, size=(batch,)), batch


def build(name, blocks, batch):
    """(model, loss, x, y, batch size) with random weights and data
    (GPT-2's batch is its test case's)."""
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name == "gpt2":
        sys.path.insert(0, ROOT)
        from tests import architectures

        case = next(c for c in architectures.SAVE_CASES if c.name == "gpt2_classifier")
        _, model = case.build_pair()
        x, y = case.data()
        return model, case.loss, x, y, len(y)
    if name == "gpt2_mid":
        import keras_hub

        backbone = keras_hub.models.GPT2Backbone(dropout=0.0, **GPT2_MID)
        pooled = keras.layers.GlobalAveragePooling1D()(backbone(backbone.input))
        return _token_classifier(keras, backbone, pooled, GPT2_MID, batch, rng, loss)
    if name == "bert_base":
        import keras_hub

        backbone = keras_hub.models.BertBackbone(dropout=0.0, **BERT_BASE)
        pooled = backbone(backbone.input)["pooled_output"]
        return _token_classifier(keras, backbone, pooled, BERT_BASE, batch, rng, loss)
    if name == "unet":
        model = unet(keras)
        x = rng.normal(size=(batch, UNET_SIZE, UNET_SIZE, 3)).astype("float32")
        masks = (x.mean(axis=-1, keepdims=True) > 0).astype("float32")
        return model, keras.losses.BinaryCrossentropy(), x, masks, batch
    if name in APPLICATIONS:
        model = getattr(keras.applications, APPLICATIONS[name])(
            weights=None, input_shape=(32, 32, 3), classes=10, classifier_activation=None
        )
        size = 32
    else:
        model = residual_cnn(keras, blocks)
        size = 16
    x = rng.normal(size=(batch, size, size, 3)).astype("float32")
    y = rng.integers(0, 10, size=(batch,))
    return model, loss, x, y, batch


def make(variant, name, jit_compile, chunk, blocks, strategy, batch):
    import keras

    import tf_als

    keras.mixed_precision.set_global_policy("mixed_float16")
    with strategy.scope():
        model, loss, x, y, batch = build(name, blocks, batch)
        inner = keras.optimizers.SGD(1e-3)
        if variant == "keras":
            optimizer = keras.optimizers.LossScaleOptimizer(inner)
        else:
            model = tf_als.instrument(model)
            interval = 1 if variant == "tf_als_1" else chunk
            optimizer = tf_als.AdaptiveLossScaleOptimizer(inner, telemetry_interval=interval)
        model.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile)
    return model, x, y, batch


# -- timing -------------------------------------------------------------------


class StepTimer:
    """Per-step wall times of `fit` calls, with whether each step was a
    scale update (read from the optimizer's step counter before the step)."""

    def __init__(self, keras, interval):
        timer = self
        self.steps = []  # (seconds, is_update)

        class Callback(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                step = int(self.model.optimizer.iterations.numpy())
                timer._update = interval > 0 and step % interval == 0
                timer._start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                if batch > 0:  # The first also sets up the iterator.
                    timer.steps.append(
                        (time.perf_counter() - timer._start, timer._update)
                    )

        self.callback = Callback()


def dataset(x, y, batch, steps):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat(steps)


def interval_of(variant, chunk):
    return {"keras": 0, "tf_als": chunk, "tf_als_1": 1}[variant]


def time_worker(args):
    """One model, one mode: set-up and per-step times of every variant."""
    import keras

    strategy = _strategy(args.strategy)
    jit = args.xla == "on"
    runs = {}
    for variant in VARIANTS:
        model, x, y, batch = make(
            variant, args.model, jit, args.chunk, args.blocks, strategy, args.batch
        )
        start = time.perf_counter()
        model.fit(dataset(x, y, batch, 1), epochs=1, verbose=0)
        setup = time.perf_counter() - start
        runs[variant] = dict(
            model=model, data=dataset(x, y, batch, args.chunk), setup=setup,
            timer=StepTimer(keras, interval_of(variant, args.chunk)),
            points=len(getattr(model, "scaling_points", ())),
        )
        # Put every tf_als variant's update step in the middle of each timed
        # chunk: the first batch of a `fit` call also sets up its iterator,
        # and is left out of the statistics. One step was applied, so after
        # chunk / 2 - 1 more, step chunk / 2 of every chunk is an update.
        model.fit(dataset(x, y, batch, args.chunk // 2 - 1), epochs=1, verbose=0)
    for _ in range(args.rounds):
        for variant, run in runs.items():
            run["model"].fit(run["data"], epochs=1, verbose=0, callbacks=[run["timer"].callback])
    return {
        variant: dict(
            setup=run["setup"], points=run["points"], steps=run["timer"].steps
        )
        for variant, run in runs.items()
    }


def _rss_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def fresh_worker(args):
    """One variant in a fresh process: the wall time of its first `fit`
    call (one step: trace, compile, run), then the resident set size (MiB)
    after it and the peak while training `--chunk` more steps."""
    strategy = _strategy(args.strategy)
    model, x, y, batch = make(
        args.variant, args.model, args.xla == "on", args.chunk, args.blocks,
        strategy, args.batch,
    )
    check = _time_first_batch_check(model)
    start = time.perf_counter()
    model.fit(dataset(x, y, batch, 1), epochs=1, verbose=0)
    setup = time.perf_counter() - start
    model.fit(dataset(x, y, batch, 1), epochs=1, verbose=0)
    after_setup = _rss_mib()
    peak, done = [after_setup], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mib())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    model.fit(dataset(x, y, batch, args.chunk), epochs=1, verbose=0)
    done.set()
    sampler.join()
    return {
        "setup": setup - check[0],
        "check": check[0],
        "after_setup": after_setup,
        "peak": peak[0],
        "trimmed": _trimmed_rss_mib(),
        "device_peak": _device_peak_mib(),
    }


def _time_first_batch_check(model):
    """A one-element list that accumulates the seconds `model`'s optimizer
    spends in its first-batch check (`preflight`, which tf_als's `fit`
    runs before the first step); stays [0.0] for Keras's."""
    seconds = [0.0]
    optimizer = model.optimizer
    check = getattr(optimizer, "preflight", None)
    if check is None:
        return seconds

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return check(*args, **kwargs)
        finally:
            seconds[0] += time.perf_counter() - start

    object.__setattr__(optimizer, "preflight", timed)
    return seconds


def _device_peak_mib():
    """The first GPU's peak allocated memory (MiB) since the process
    started, from TensorFlow's allocator; None without a GPU."""
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        return None
    return tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2.0**20


def _trimmed_rss_mib():
    """The resident set size after glibc hands the heap's free pages back
    to the system (`malloc_trim(0)`): what is live, without what set-up
    (tracing, XLA's compiler) allocated and freed but the allocator kept.
    None where glibc is not the allocator."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return _rss_mib()


def _strategy(kind):
    import tensorflow as tf

    if kind == "mirrored":
        return tf.distribute.MirroredStrategy(
            [d.name for d in tf.config.list_logical_devices("CPU")]
        )
    return tf.distribute.get_strategy()


def _configure(strategy):
    if strategy == "mirrored":
        import tensorflow as tf

        (cpu,) = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )


# -- summary ------------------------------------------------------------------


def _median(values):
    import numpy as np

    return float(np.median(list(values)))


def _mean(values):
    import numpy as np

    return float(np.mean(list(values)))


def _ratio_interval(numerator, denominator, resamples=2000, seed=0):
    """(5th, 95th) percentile of median(numerator) / median(denominator)
    over bootstrap resamples of each list of step times."""
    import numpy as np

    rng = np.random.default_rng(seed)
    top, bottom = np.asarray(numerator), np.asarray(denominator)
    ratios = [
        np.median(rng.choice(top, top.size)) / np.median(rng.choice(bottom, bottom.size))
        for _ in range(resamples)
    ]
    low, high = np.percentile(ratios, [5, 95])
    return float(low), float(high)


def summarise(timed):
    """Ratios to Keras's median step (see the module docstring)."""
    keras_step = _median(s for s, _ in timed["keras"]["steps"])
    als = timed["tf_als"]["steps"]
    between = _median(s for s, update in als if not update)
    updates = [s for s, update in als if update]
    extra = _median(updates) - between
    every = _median(s for s, _ in timed["tf_als_1"]["steps"])
    return {
        "points": timed["tf_als"]["points"],
        "keras_ms": 1e3 * keras_step,
        "between_updates": between / keras_step,
        "between_updates_interval": _ratio_interval(
            [s for s, update in als if not update],
            [s for s, _ in timed["keras"]["steps"]],
        ),
        "update_step_extra": extra / between,
        "interval_1": every / keras_step,
        # What each point adds to a step without telemetry, in microseconds:
        # flat as the points grow, if the cost per point is.
        "per_point_us": 1e6 * (between - keras_step) / max(timed["tf_als"]["points"], 1),
        "interval_10": (between + extra / 10) / keras_step,
        "interval_100": (between + extra / 100) / keras_step,
        "update_steps": len(updates),
        "step_seconds": {v: timed[v]["steps"] for v in VARIANTS},
        "setup_in_one_process_seconds": {v: timed[v]["setup"] for v in VARIANTS},
    }


def _run_worker(*arguments):
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *arguments],
        capture_output=True, text=True, cwd=ROOT,
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"worker {' '.join(arguments)} exited with {out.returncode}:\n"
            + "\n".join(out.stderr.strip().splitlines()[-30:])
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


COLUMNS = (
    ("batch", "batch", "{:d}"),
    ("points", "points", "{:d}"),
    ("keras_ms", "Keras step (ms)", "{:.1f}"),
    ("between_updates", "between updates", "{:.3f}"),
    ("between_updates_interval", "its 90% interval", "{0[0]:.3f}-{0[1]:.3f}"),
    ("update_step_extra", "update step extra (plain steps)", "{:.2f}"),
    ("per_point_us", "extra per point (us)", "{:.0f}"),
    ("interval_1", "interval 1", "{:.3f}"),
    ("interval_10", "interval 10", "{:.3f}"),
    ("interval_100", "interval 100", "{:.3f}"),
    ("setup", "fit set-up without check", "{:.2f}"),
    ("check_steps", "first-batch check (Keras steps)", "{:.1f}"),
    ("memory", "peak memory", "{:.3f}"),
    ("memory_trimmed", "memory after trim", "{:.3f}"),
)


def table(rows):
    header = ["model", "XLA", "strategy"] + [title for _, title, _ in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        cells = [row["model"], row["xla"], row["strategy"]]
        for key, _, form in COLUMNS:
            value = row.get(key)
            cells.append("-" if value is None else form.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--xla", default="off,on")
    parser.add_argument("--chunk", type=int, help="steps per chunk (default: per model)")
    parser.add_argument("--rounds", type=int, help="timed chunks per variant (default: per model)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-mirrored", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--output", default="overhead")
    # Worker arguments.
    parser.add_argument("--worker", choices=("time", "fresh"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="single", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _configure(args.strategy)
        import warnings

        warnings.simplefilter("ignore")
        result = time_worker(args) if args.worker == "time" else fresh_worker(args)
        print(json.dumps(result))
        return

    rows = []

    def measure(model, xla, strategy="single", blocks=4, memory=True, label=None):
        batch, chunk, rounds = SETTINGS[(model, xla)]
        chunk, rounds = args.chunk or chunk, args.rounds or rounds
        base = [
            "--chunk", str(chunk), "--rounds", str(rounds),
            "--model", model, "--xla", xla, "--blocks", str(blocks),
        ] + ([] if batch is None else ["--batch", str(batch)])
        timed = _run_worker("--worker", "time", "--strategy", strategy, *base)
        row = dict(
            model=label or model, xla=xla, strategy=strategy, batch=batch, chunk=chunk,
            rounds=rounds,
            **summarise(timed),
        )
        fresh = {
            v: _run_worker("--worker", "fresh", "--strategy", strategy, "--variant", v, *base)
            for v in ("keras", "tf_als")
        }
        row["setup"] = fresh["tf_als"]["setup"] / fresh["keras"]["setup"]
        row["setup_seconds"] = {v: fresh[v]["setup"] for v in fresh}
        row["check_seconds"] = fresh["tf_als"]["check"]
        if row.get("keras_ms"):
            row["check_steps"] = fresh["tf_als"]["check"] / (row["keras_ms"] / 1000.0)
        if memory:
            row["memory"] = fresh["tf_als"]["peak"] / fresh["keras"]["peak"]
            if fresh["keras"].get("trimmed") and fresh["tf_als"].get("trimmed"):
                row["memory_trimmed"] = (
                    fresh["tf_als"]["trimmed"] / fresh["keras"]["trimmed"]
                )
            row["memory_mib"] = {
                v: {k: fresh[v].get(k) for k in ("after_setup", "peak", "trimmed")}
                for v in fresh
            }
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
        write(rows, args.output)  # after every row: a long run can be cut

    for model in args.models.split(","):
        for xla in args.xla.split(","):
            measure(model, xla, memory=not args.no_memory)
    if not args.no_mirrored:
        for model in args.models.split(","):
            if model in MIRRORED:
                measure(model, "off", strategy="mirrored", memory=False)
    if not args.no_sweep:
        for blocks in SWEEP:
            measure("cnn", "on", blocks=blocks, memory=False, label=f"cnn, {blocks} blocks")

    print("\n" + table(rows))


def write(rows, output):
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, output + ".json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(RESULTS, output + ".md"), "w") as f:
        f.write(
            "Written by `python benchmarks/overhead.py` (ratios to Keras's "
            "LossScaleOptimizer, measured side by side; chunks and rounds "
            "per model in overhead.json).\n\n" + table(rows) + "\n"
        )


if __name__ == "__main__":
    main()
