"""The papers' research questions at CPU scale: one command per experiment.

    python benchmarks/replication.py underflow   # RQ-underflow (~35 min on 2 cores)
    python benchmarks/replication.py accuracy    # RQ-accuracy  (~2 h; 57 min without the fixed scales)
    python benchmarks/replication.py tuning      # RQ-tuning    (~50 min)
    python benchmarks/overhead.py                # RQ-overhead  (its own script)

Add `--quick` for a smoke run (a few steps, used by the tests). Each
command prints its table and writes `<output-dir>/<experiment>.md` and
`.json` (default output dir: `benchmarks/results`); `underflow` also writes
`underflow.png`. `docs/replication.md` collects the committed results.

Every experiment trains on scikit-learn's digits (1437 training and 360
test images, 8x8), batch 64, Adam 1e-3, with `fit`. Within a seed every
scaler starts from the same initial weights and sees the same batches.

Scalers:

- `float32`: no mixed precision, the reference.
- `fixed-<S>`: mixed_float16 with a constant loss scale S: the loss is
  multiplied by S, the gradients divided by S and applied as they are, with
  no finiteness check (static loss scaling as in Micikevicius et al.; a
  non-finite gradient reaches the weights and the run diverges).
- `keras`: mixed_float16 with `keras.optimizers.LossScaleOptimizer`
  (dynamic: starts at 2**15, halves and skips on non-finite gradients,
  doubles after 2000 finite steps).
- `tf_als`: mixed_float16, `tf_als.instrument` + `AdaptiveLossScaleOptimizer`
  with its defaults (each point's scale from its gradient's amax, every
  step).
- `tf_als-paper`: the same with `rule="paper"`: the ALS paper's scale, the
  reciprocal of the 1% quantile of the gradient's nonzero magnitudes,
  capped by safety, every 100 steps.

Underflow is measured as in `tf_als.diagnose`: on a fixed held-out batch, at
the run's current weights and scales, the share of a layer's weight-gradient
elements that are exactly zero in the run's float16 backward pass but
nonzero in float32 (a float32 copy of the model with the same weights).
The probes run on copies, so measuring never changes a run.

Models: `cnn` (the demo's conv + BatchNorm net), `resnet` (a small residual
net with BatchNorm) and `sigmoid-mlp` (16 sigmoid Dense layers, the demo's
underflow showcase: its gradients shrink by about 4x per layer).
"""

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FIXED_SCALES = (1, 128, 1024, 32768)
SCALERS = (
    ("float32",) + tuple(f"fixed-{s}" for s in FIXED_SCALES)
    + ("keras", "tf_als", "tf_als-paper")
)
TUNING_SCALES = tuple(2**k for k in range(0, 25, 3))  # 1, 8, ..., 2**24
MODELS = ("cnn", "resnet", "sigmoid-mlp")
UNDERFLOW_LIMIT = 0.01  # the paper's target: at most 1% of a layer's gradient
ACCURACY_TOLERANCE = 0.02  # tuning: "matches float32" within 2 points
BATCH_SIZE = 64
LEARNING_RATE = 1e-3
BN_MOMENTUM = 0.9  # as in the demo: short runs must evaluate sensibly


# -- models -------------------------------------------------------------------


def build_model(name, input_shape, classes):
    import keras

    from tf_als._src.demo import models

    if name in ("cnn", "sigmoid-mlp"):
        return models.build_model(name, input_shape, classes)
    if name != "resnet":
        raise ValueError(f"`model` must be one of {', '.join(MODELS)}; received {name!r}.")
    layers = keras.layers
    inputs = keras.Input(input_shape)
    x = layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = layers.BatchNormalization(momentum=BN_MOMENTUM)(x)
    x = layers.ReLU()(x)
    for filters, stride in ((16, 1), (32, 2), (32, 1)):
        y = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
        y = layers.BatchNormalization(momentum=BN_MOMENTUM)(y)
        y = layers.ReLU()(y)
        y = layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
        y = layers.BatchNormalization(momentum=BN_MOMENTUM)(y)
        if stride != 1 or x.shape[-1] != filters:
            x = layers.Conv2D(filters, 1, strides=stride, use_bias=False)(x)
        x = layers.ReLU()(layers.Add()([x, y]))
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(classes, dtype="float32")(x)
    return keras.Model(inputs, outputs, name="resnet")


# -- scalers ------------------------------------------------------------------


def fixed_scale_optimizer(inner, scale):
    """Static loss scaling: Keras's LossScaleOptimizer with the scale held
    at `scale` and gradients applied without a finiteness check."""
    import keras

    class FixedLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
        def apply(self, grads, trainable_variables=None):
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
                self.built = True
            unscaled = [
                None if g is None else g / keras.ops.cast(self.dynamic_scale, g.dtype)
                for g in grads
            ]
            self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)

    return FixedLossScaleOptimizer(inner, initial_scale=float(scale))


def scale_of(scaler):
    return float(scaler.split("-", 1)[1]) if scaler.startswith("fixed-") else None


# -- underflow probe ----------------------------------------------------------


class UnderflowProbe:
    """Measures a (mixed_float16) run's per-layer underflow on a fixed
    batch, with the run's own layers: the float32 reference runs them under
    a float32 policy for the duration (as `tf_als.diagnose` does); nothing
    the run's compiled train function uses changes."""

    def __init__(self, model, x, y, rule="amax"):
        import keras

        import tf_als

        self.plain = model.uninstrumented() if isinstance(model, tf_als.InstrumentedModel) else model
        self.x, self.y = x, y
        self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.live_points = getattr(model, "scaling_points", None)
        self.probe = None
        if self.live_points:
            # It shares the run's variables, so the run's optimizer finds it
            # among the models it trains (`owners`) and checks its knobs:
            # compiled with the run's rule. Its scales are copied from the
            # run's before each measurement.
            self.probe = tf_als.instrument(self.plain)
            self.probe.compile(
                optimizer=tf_als.AdaptiveLossScaleOptimizer(
                    keras.optimizers.SGD(0.0), rule=rule
                ),
                loss=self.loss,
            )
        index = {id(v): i for i, v in enumerate(self.plain.trainable_variables)}
        self.layers = [
            (layer.name, [index[id(v)] for v in layer.trainable_weights])
            for layer in self.plain.layers
            if layer.trainable_weights
        ]

    def measure(self, optimizer):
        """{layer name: flushed share} at the run's current state."""
        import keras
        import numpy as np

        from tf_als._src.model import _keras
        from tf_als._src.monitoring import passes
        from tf_als._src.monitoring import report

        variables = self.plain.trainable_variables
        # The run's own batch, as it is: no seed state to rewind.
        batch = passes.Batch(self.x, self.y, self.loss, True, lambda: None)
        with _keras.dtype_policy(_keras.all_layers(self.plain), "float32"):
            expected, _ = passes.gradient_pass(self.plain, variables, batch)()
        scale = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
        model = self.plain
        if self.probe is not None:
            for live, copy in zip(self.live_points, self.probe.scaling_points):
                copy.scale.assign(live.scale)
            model = self.probe
        grads, _ = passes.gradient_pass(model, variables, batch)(scale)
        result = {}
        for name, positions in self.layers:
            got = [np.ravel(grads[i]) for i in positions]
            want = [np.ravel(expected[i]) for i in positions]
            result[name] = report._flushed(got, want)
        return result


# -- one training run ---------------------------------------------------------


def train(model_name, scaler, seed, data, epochs, measure_every, steps=None):
    """Trains one run; returns its results as a JSON-able dict.

    measure_every: measure underflow every this many steps (and at the end);
        None measures once, at the end. float32 runs are never measured.
    steps: stop after this many steps (for --quick).
    """
    import keras
    import numpy as np

    import tf_als

    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(seed)
    initial = build_model(model_name, data.x_train.shape[1:], data.classes).get_weights()
    order = np.random.default_rng(seed).permutation(len(data.x_train))
    x_train, y_train = data.x_train[order], data.y_train[order]

    policy = "float32" if scaler == "float32" else "mixed_float16"
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(seed)
    model = build_model(model_name, data.x_train.shape[1:], data.classes)
    model.set_weights(initial)
    inner = keras.optimizers.Adam(LEARNING_RATE)
    if scaler == "float32":
        optimizer = inner
    elif scaler == "keras":
        optimizer = keras.optimizers.LossScaleOptimizer(inner)
    elif scaler in ("tf_als", "tf_als-paper"):
        model = tf_als.instrument(model)
        rule = "paper" if scaler == "tf_als-paper" else "amax"
        optimizer = tf_als.AdaptiveLossScaleOptimizer(inner, rule=rule)
    else:
        optimizer = fixed_scale_optimizer(inner, scale_of(scaler))
    probe = None
    if scaler != "float32":
        # Before compile: clone_model would otherwise copy the compile
        # config, and the benchmark's optimizer is not registered.
        probe = UnderflowProbe(
            model, data.x_test[:BATCH_SIZE], data.y_test[:BATCH_SIZE],
            rule="paper" if scaler == "tf_als-paper" else "amax",
        )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    curve = []

    class Measure(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
            if probe is not None and measure_every and step % measure_every == 0:
                curve.append((step, probe.measure(optimizer)))
            self.batches = getattr(self, "batches", 0) + 1
            if steps is not None and self.batches >= steps:
                self.model.stop_training = True

    started = time.perf_counter()
    model.fit(
        x_train, y_train, batch_size=BATCH_SIZE, epochs=epochs, verbose=0,
        shuffle=False, callbacks=[Measure()],
    )
    loss, accuracy = model.evaluate(data.x_test, data.y_test, verbose=0)
    plain = model.uninstrumented() if isinstance(model, tf_als.InstrumentedModel) else model
    finite = all(np.all(np.isfinite(w)) for w in plain.get_weights())
    final = probe.measure(optimizer) if probe is not None else {}
    result = {
        "model": model_name,
        "scaler": scaler,
        "seed": seed,
        "test_accuracy": float(accuracy),
        "test_loss": float(loss),
        "diverged": bool(not finite or not math.isfinite(loss)),
        "final_underflow": final,
        "worst_final_underflow": max(final.values()) if final else 0.0,
        "curve": curve,
        "loss_scale": (
            float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
            if scaler != "float32" else None
        ),
        "seconds": time.perf_counter() - started,
    }
    if scaler.startswith("tf_als"):
        result["layer_scales"] = tf_als.scales(model)
    keras.mixed_precision.set_global_policy("float32")
    return result


def run_all(jobs, data, args, measure_every):
    results = []
    for number, (model_name, scaler, seed) in enumerate(jobs, 1):
        result = train(
            model_name, scaler, seed, data, args.epochs, measure_every,
            steps=3 if args.quick else None,
        )
        results.append(result)
        print(
            f"[{number}/{len(jobs)}] {model_name:<11} {scaler:<12} seed {seed}: "
            f"accuracy {result['test_accuracy']:.4f}, worst-layer underflow "
            f"{result['worst_final_underflow']:.2%}"
            f"{', DIVERGED' if result['diverged'] else ''} "
            f"({result['seconds']:.0f} s)",
            flush=True,
        )
    return results


# -- experiments --------------------------------------------------------------


def mean_worst(curve):
    """Mean over measurements of the worst layer's underflow."""
    return sum(max(m.values()) for _, m in curve) / len(curve) if curve else 0.0


def peak_worst(curve):
    return max((max(m.values()) for _, m in curve), default=0.0)


def layers_over(final, limit=UNDERFLOW_LIMIT):
    return sum(v > limit for v in final.values())


def underflow_experiment(args, data):
    scalers = [s for s in args.scalers or SCALERS if s != "float32"]
    jobs = [(m, s, 0) for m in args.models for s in scalers]
    return run_all(jobs, data, args, args.measure_every)


def underflow_table(results, args):
    lines = [
        "| model | scaler | worst layer, mean over training | worst layer, peak | "
        "worst layer, end | layers over 1% at end | diverged |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['model']} | {r['scaler']} | {mean_worst(r['curve']):.2%} | "
            f"{peak_worst(r['curve']):.2%} | {r['worst_final_underflow']:.2%} | "
            f"{layers_over(r['final_underflow'])} of {len(r['final_underflow'])} | "
            f"{'yes' if r['diverged'] else 'no'} |"
        )
    plot_underflow(results, os.path.join(args.output_dir, "underflow.png"))
    return "\n".join(lines)


def plot_underflow(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in results}, key=MODELS.index)
    figure, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for axis, model in zip(axes[0], models):
        for r in results:
            if r["model"] != model or not r["curve"]:
                continue
            steps = [s for s, _ in r["curve"]]
            worst = [max(m.values()) * 100 for _, m in r["curve"]]
            axis.plot(steps, worst, label=r["scaler"], linewidth=2 if r["scaler"] == "tf_als" else 1)
        axis.axhline(UNDERFLOW_LIMIT * 100, color="grey", linestyle=":", linewidth=1)
        axis.set_title(model)
        axis.set_xlabel("training step")
        axis.set_ylabel("worst layer's underflow (% of elements)")
        axis.set_ylim(-2, 100)
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def accuracy_experiment(args, data):
    seeds = list(range(args.seeds))
    scalers = args.scalers or SCALERS
    jobs = [(m, s, seed) for m in args.models for s in scalers for seed in seeds]
    return run_all(jobs, data, args, None)


def accuracy_table(results, args):
    lines = [
        "| model | scaler | test accuracy, mean | spread (min to max) | "
        "test loss, mean | spread (min to max) | diverged runs | "
        "worst-layer underflow at end, mean |",
        "| --- | --- | ---: | --- | ---: | --- | ---: | ---: |",
    ]
    scalers = [s for s in SCALERS if any(r["scaler"] == s for r in results)]
    for model in args.models:
        for scaler in scalers:
            runs = [r for r in results if r["model"] == model and r["scaler"] == scaler]
            accuracies = [r["test_accuracy"] for r in runs]
            losses = [r["test_loss"] for r in runs]
            underflow = sum(r["worst_final_underflow"] for r in runs) / len(runs)
            lines.append(
                f"| {model} | {scaler} | {sum(accuracies) / len(runs):.4f} | "
                f"{min(accuracies):.4f} to {max(accuracies):.4f} | "
                f"{sum(losses) / len(runs):.4f} | {min(losses):.4f} to {max(losses):.4f} | "
                f"{sum(r['diverged'] for r in runs)} of {len(runs)} | "
                f"{'-' if scaler == 'float32' else f'{underflow:.2%}'} |"
            )
    return "\n".join(lines)


def verdict(run, reference):
    """Why a run failed ('' when it did not)."""
    if run["diverged"]:
        return "diverged"
    if mean_worst(run["curve"]) > UNDERFLOW_LIMIT:
        return "underflow"
    if run["test_accuracy"] < reference["test_accuracy"] - ACCURACY_TOLERANCE:
        return "accuracy"
    return ""


def tuning_scalers():
    """float32, every fixed scale of the sweep, then the scalers that need
    no tuning."""
    fixed = [f"fixed-{s}" for s in TUNING_SCALES]
    return ["float32"] + fixed + ["keras", "tf_als", "tf_als-paper"]


def tuning_experiment(args, data):
    scalers = tuning_scalers()
    jobs = [(m, s, 0) for m in args.models for s in scalers]
    return run_all(jobs, data, args, args.measure_every)


def tuning_table(results, args):
    scalers = [s for s in tuning_scalers() if any(r["scaler"] == s for r in results)]
    header = "| scaler | " + " | ".join(args.models) + " |"
    lines = [header, "|" + " --- |" * (len(args.models) + 1)]
    failures = {m: 0 for m in args.models}
    for scaler in scalers[1:]:
        cells = []
        for model in args.models:
            reference = next(r for r in results if r["model"] == model and r["scaler"] == "float32")
            run = next(r for r in results if r["model"] == model and r["scaler"] == scaler)
            why = verdict(run, reference)
            if why and scaler.startswith("fixed-"):
                failures[model] += 1
            cells.append(
                f"{'FAIL (' + why + ')' if why else 'ok'}: {run['test_accuracy']:.3f}, "
                f"{mean_worst(run['curve']):.1%}"
            )
        lines.append(f"| {scaler} | " + " | ".join(cells) + " |")
    lines.append(
        "| **fixed scales failing** | "
        + " | ".join(f"**{failures[m]} of {len(TUNING_SCALES)}**" for m in args.models)
        + " |"
    )
    lines.append(
        "| float32 accuracy | "
        + " | ".join(
            f"{next(r for r in results if r['model'] == m and r['scaler'] == 'float32')['test_accuracy']:.3f}"
            for m in args.models
        )
        + " |"
    )
    return "\n".join(lines)


EXPERIMENTS = {
    "underflow": (underflow_experiment, underflow_table, ("sigmoid-mlp", "cnn", "resnet"), 10),
    "accuracy": (accuracy_experiment, accuracy_table, ("cnn", "resnet"), 15),
    "tuning": (tuning_experiment, tuning_table, ("sigmoid-mlp", "cnn", "resnet"), 10),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python benchmarks/replication.py",
        description="The papers' research questions at CPU scale (see the module docstring).",
    )
    parser.add_argument("experiment", choices=sorted(EXPERIMENTS),
                        help="underflow: per-layer underflow over training; "
                        "accuracy: final accuracy over seeds; tuning: how many "
                        "fixed scales fail")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=None,
                        help="models to run (default: the experiment's own list)")
    parser.add_argument("--scalers", nargs="+", choices=SCALERS, default=None,
                        help="underflow and accuracy: scalers to run (default all)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs per run (default: underflow 10, accuracy 15, tuning 10)")
    parser.add_argument("--seeds", type=int, default=3,
                        help="accuracy: seeds per model and scaler (default 3)")
    parser.add_argument("--measure-every", type=int, default=10,
                        help="underflow and tuning: measure every this many steps (default 10)")
    parser.add_argument("--output-dir", default=os.path.join("benchmarks", "results"),
                        help="where the table, JSON and plot go (default benchmarks/results)")
    parser.add_argument("--table-only", action="store_true",
                        help="do not train: rebuild the table (and plot) from "
                        "<output-dir>/<experiment>.json")
    parser.add_argument("--quick", action="store_true",
                        help="3 steps per run, one seed, for tests")
    args = parser.parse_args(argv)
    for name in ("epochs", "seeds", "measure_every"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {value}")
    _, _, models, epochs = EXPERIMENTS[args.experiment]
    args.models = args.models or list(models)
    args.epochs = args.epochs or epochs
    if args.quick:
        args.epochs, args.seeds, args.measure_every = 1, 1, 2
    return args


def main(argv=None):
    args = parse_args(argv)
    from tf_als._src.demo import datasets

    data = datasets.load("digits")
    os.makedirs(args.output_dir, exist_ok=True)
    experiment, render = EXPERIMENTS[args.experiment][:2]
    started = time.perf_counter()
    json_path = os.path.join(args.output_dir, f"{args.experiment}.json")
    if args.table_only:
        with open(json_path) as handle:
            saved = json.load(handle)
        for key in ("models", "epochs", "seeds"):
            setattr(args, key, saved["args"][key])
        results = saved["results"]
    else:
        results = experiment(args, data)
    text = render(results, args)
    title = (
        f"RQ-{args.experiment}: digits ({len(data.x_train)} train / {len(data.x_test)} test), "
        f"{args.epochs} epochs, batch {BATCH_SIZE}, Adam {LEARNING_RATE:g}"
    )
    with open(os.path.join(args.output_dir, f"{args.experiment}.md"), "w") as handle:
        handle.write(f"{title}\n\n{text}\n")
    if not args.table_only:
        with open(json_path, "w") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=1)
    print(f"\n{title}\n\n{text}\n\n({time.perf_counter() - started:.0f} s)")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
