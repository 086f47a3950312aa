"""The main job: float16 training three ways, on two small problems.

    python -m tf_als.demo            # about 3 minutes on 2 CPU cores
    python -m tf_als.demo --quick    # a few seconds of training, for tests

Each problem is trained from the same initial weights on the same batches
in float32, in mixed_float16 with Keras's `LossScaleOptimizer`, and in
mixed_float16 with tf_als:

1. underflow: `deep-sigmoid` on scikit-learn's digits. The gradients of
   its first layers span more than one float16 loss scale can hold. At the
   final weights, on held-out batches, each run's weight gradients are
   compared with float32's per layer (`tf_als.diagnose`): the share of
   elements flushed to zero and the relative error.
2. failure: a house-price regression (`datasets.prices`) whose float16
   output layer must reach values above 65504, float16's largest. No loss
   scale helps; the layer must compute in float32.

One line per run, then a table per problem and what they show. It writes
both tables (`results.md`, `results.json`), TensorBoard logs
(`tensorboard --logdir <output-dir>/tensorboard`) and a PNG of tf_als's
per-layer scales in the underflow run.
"""

import argparse
import json
import math
import os
import sys
import time
import warnings

from tf_als._src.demo import models
from tf_als._src.demo import tables

_TF_ALS_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = ("deep-sigmoid", "cnn", "sigmoid-mlp")
PARTS = ("underflow", "failure")


# The underflow part trains with XLA, as Keras does on a GPU: on the CPU,
# TensorFlow's own float16 kernels are slow (deep-sigmoid, measured in one
# process with time.process_time: Keras 269 ms of CPU a step without XLA,
# 10 with it; tf_als 323 and 14, after 21 s and 44 s of compilation). The
# gradients the table compares come from `tf_als.diagnose`, without XLA.
# `--quick` (8 steps) compiles without it: there compilation is the cost.
UNDERFLOW_XLA = True

# The price model: Adam at 3.0 (its output weights must reach the
# hundreds of thousands), cosine-decayed to 1% of that over the run so the
# final weights have settled; batches of 32.
PRICE_LEARNING_RATE = 3.0
PRICE_BATCH = 32
# Epochs of the failure part: 24 steps each.
FAILURE_EPOCHS = 15


class _StepCounter:
    """Keras callback factory: the process's CPU time over each epoch after
    the first (which includes compilation; CPU time, not wall time, so that
    other jobs on the machine do not count), batches run and steps applied."""

    def __new__(cls):
        import keras

        class StepCounter(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.epoch_times, self.timed_steps = [], 0
                self.batches, self.skipped = 0, 0

            def on_epoch_begin(self, epoch, logs=None):
                self._began = time.process_time()
                self._applied_before = self._read_iterations()
                self._batches = 0

            def on_train_batch_end(self, batch, logs=None):
                self._batches += 1

            def on_epoch_end(self, epoch, logs=None):
                seconds = time.process_time() - self._began
                if epoch > 0:
                    self.epoch_times.append(seconds)
                    self.timed_steps += self._batches
                applied = self._read_iterations() - self._applied_before
                self.batches += self._batches
                self.skipped += self._batches - applied

            def _read_iterations(self):
                return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

        return StepCounter()


def _fit(run, model, inner, data, *, loss, epochs, batch_size, log_dir, args, jit_compile="auto"):
    """Compiles and fits one run. Returns (the trained model, its optimizer,
    the step counter, a ScaleHistory or None, tf_als's warnings)."""
    import keras

    import tf_als

    history = None
    if run == "float32":
        optimizer = inner
    elif run == "keras":
        optimizer = keras.optimizers.LossScaleOptimizer(inner)
    else:
        model = tf_als.instrument(model)
        optimizer = tf_als.AdaptiveLossScaleOptimizer(
            inner, telemetry_interval=args.telemetry_interval
        )
        history = tf_als.callbacks.ScaleHistory(log_dir=log_dir)
    counter = _StepCounter()
    callbacks = [keras.callbacks.TensorBoard(log_dir), counter]
    if history is not None:
        callbacks.insert(0, history)
    model.compile(
        optimizer=optimizer, loss=loss, metrics=_metrics(data), jit_compile=jit_compile
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        model.fit(
            data.x_train,
            data.y_train,
            batch_size=batch_size,
            epochs=epochs,
            verbose=args.verbose,
            callbacks=callbacks,
            shuffle=False,
        )
    messages = _tf_als_warnings(caught)
    return model, optimizer, counter, history, messages


def _tf_als_warnings(caught):
    """The messages of tf_als's own warnings (the demo prints them under
    the run's line); any other warning is passed on as it came."""
    messages = []
    for warning in caught:
        if warning.filename.startswith(_TF_ALS_ROOT) or "tf_als" in str(warning.message):
            messages.append(str(warning.message))
        else:
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )
    return list(dict.fromkeys(messages))


def _metrics(data):
    return ["accuracy"] if data.classes else []


def _fresh(run, build, args):
    """The run's model under its policy, from the shared initial weights."""
    import keras

    keras.mixed_precision.set_global_policy("float32" if run == "float32" else "mixed_float16")
    keras.utils.set_random_seed(args.seed)
    return build()


def _initial_weights(build, args):
    import keras

    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(args.seed)
    return build().get_weights()


def _scale(run, optimizer):
    import keras

    if run == "float32":
        return 1.0
    return float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))


def run_underflow(run, data, initial, args, log_root):
    """Trains part 1's run `run`; returns (results dict, ScaleHistory or None)."""
    import keras

    began = time.perf_counter()
    model = _fresh(run, lambda: models.build_model(args.model, data.x_train.shape[1:], data.classes), args)
    model.set_weights(initial)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model, optimizer, counter, history, messages = _fit(
        run, model, keras.optimizers.Adam(args.learning_rate), data,
        loss=loss, epochs=args.epochs, batch_size=args.batch_size,
        log_dir=os.path.join(log_root, "underflow", run), args=args,
        jit_compile=UNDERFLOW_XLA and not args.quick,
    )
    test_loss, accuracy = model.evaluate(data.x_test, data.y_test, verbose=0)
    layers = layer_precision(run, model, data, args, loss)
    worst = max(layers, key=lambda name: layers[name]) if layers else None
    result = {
        "test_accuracy": float(accuracy),
        "test_loss": float(test_loss),
        "steps": counter.batches,
        "skipped_steps": counter.skipped,
        "loss_scale": _scale(run, optimizer),
        "step_seconds": sum(counter.epoch_times) / max(counter.timed_steps, 1),
        "layers": layers,
        "worst_layer": worst,
        "worst_underflow": layers[worst][0] if worst else 0.0,
        "worst_gradient_error": layers[worst][1] if worst else 0.0,
        "seconds": time.perf_counter() - began,
        "warnings": messages,
    }
    return result, history


def layer_precision(run, model, data, args, loss, batches=4):
    """{layer name: (underflow, relative error)} of the run's weight
    gradients against float32's at its final weights: the mean over
    `batches` held-out batches of `tf_als.diagnose`'s figures for the
    run's own scaling (Keras's for `keras`, tf_als's for `tf_als`). Empty
    for the float32 run."""
    import numpy as np

    import tf_als

    if run == "float32":
        return {}
    kind = "keras" if run == "keras" else "als"
    names, underflow, error = None, [], []
    for start in range(0, batches * args.batch_size, args.batch_size):
        x = data.x_test[start : start + args.batch_size]
        y = data.y_test[start : start + args.batch_size]
        if len(x) == 0:
            break
        report = tf_als.diagnose(model, x, y, loss=loss, verbose=False)
        names = [r.layer for r in report.rows]
        underflow.append([getattr(r, f"{kind}_underflow") for r in report.rows])
        error.append([getattr(r, f"{kind}_error") for r in report.rows])
    means = zip(np.mean(underflow, axis=0), np.mean(error, axis=0))
    return {name: [float(u), float(e)] for name, (u, e) in zip(names, means)}


def run_failure(run, data, initial, args, log_root, epochs):
    """Trains part 2's run `run` (the price regression); returns its
    results dict."""
    import keras

    import tf_als

    began = time.perf_counter()
    model = _fresh(run, lambda: models.build_price_model(data.x_train.shape[1]), args)
    model.set_weights(initial)
    steps = epochs * math.ceil(len(data.x_train) / PRICE_BATCH)
    schedule = keras.optimizers.schedules.CosineDecay(
        PRICE_LEARNING_RATE, decay_steps=steps, alpha=0.01
    )
    model, optimizer, counter, _, messages = _fit(
        run, model, keras.optimizers.Adam(schedule), data,
        loss=keras.losses.MeanSquaredError(), epochs=epochs,
        batch_size=PRICE_BATCH, log_dir=os.path.join(log_root, "failure", run),
        args=args,
    )
    predictions = model.predict(data.x_test, batch_size=256, verbose=0)
    promoted = [p.layer for p in tf_als.promoted(model)] if run == "tf_als" else []
    return {
        "test_r2": tables.r2(data.y_test, predictions),
        "steps": counter.batches,
        "skipped_steps": counter.skipped,
        "loss_scale": _scale(run, optimizer),
        "promoted": promoted,
        "seconds": time.perf_counter() - began,
        "warnings": messages,
    }


def parse_args(argv=None):
    """The demo's options (`python -m tf_als.demo --help`)."""
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "telemetry_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if not args.learning_rate > 0:
        parser.error(f"--learning-rate must be > 0; got {args.learning_rate}")
    return args


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m tf_als.demo",
        description="Train two small models in float32, in float16 with "
        "Keras's LossScaleOptimizer and in float16 with tf_als, and compare "
        "them: 'underflow' (gradients one global loss scale flushes) and "
        "'failure' (a layer float16 cannot compute).",
    )
    add = parser.add_argument
    add("--parts", choices=PARTS + ("both",), default="both",
        help="which problems to run (default both)")
    add("--model", choices=MODELS, default="deep-sigmoid",
        help="the underflow part's model. deep-sigmoid (default): 20 sigmoid "
        "layers that also read the input; it trains well, and its first "
        "layers' gradients span more than one float16 loss scale can hold. "
        "cnn: a small conv net with batch normalisation, which one global "
        "scale serves. sigmoid-mlp: 16 plain sigmoid layers (the textbook "
        "vanishing-gradient network; it barely trains, in float32 too)")
    add("--dataset", choices=("digits", "mnist"), default="digits",
        help="the underflow part's data: digits ships with scikit-learn "
        "(default); mnist reads a local mnist.npz (see --data-path)")
    add("--data-path", default=None,
        help="mnist.npz for --dataset mnist (default "
        "~/.keras/datasets/mnist.npz); never downloaded")
    add("--epochs", type=int, default=20,
        help="the underflow part's training epochs (default 20; the failure "
        f"part trains {FAILURE_EPOCHS})")
    add("--batch-size", type=int, default=64,
        help="the underflow part's batch size (default 64)")
    add("--learning-rate", type=float, default=1e-3,
        help="the underflow part's Adam learning rate (default 1e-3)")
    add("--telemetry-interval", type=int, default=100,
        help="steps between tf_als telemetry records (default 100)")
    add("--output-dir", default="tf_als_runs",
        help="where logs, plot and results go (default ./tf_als_runs)")
    add("--seed", type=int, default=0, help="random seed (default 0)")
    add("--quick", action="store_true",
        help="a few seconds of training on a subset, for tests")
    add("--verbose", type=int, choices=(0, 1, 2), default=0,
        help="Keras fit verbosity: 0 one line per run (default), 1 tables.progress "
        "bars, 2 one line per epoch")
    return parser


def main(argv=None):
    """Runs the demo; returns {part: {run: results dict}}."""
    from tf_als._src.demo import quiet

    args = parse_args(argv)
    with quiet.filtered_stderr():
        return _main(args)


def _main(args):
    parts = PARTS if args.parts == "both" else (args.parts,)
    os.makedirs(args.output_dir, exist_ok=True)
    log_root = os.path.join(args.output_dir, "tensorboard")
    results, texts, history = {}, [], None
    if "underflow" in parts:
        results["underflow"], history = _underflow_part(args, log_root)
        texts.append((tables.underflow_table(results["underflow"]), tables.underflow_summary(results["underflow"])))
    if "failure" in parts:
        results["failure"] = _failure_part(args, log_root)
        texts.append((tables.failure_table(results["failure"]), tables.failure_summary(results["failure"])))
    _write(args, results, texts, history, log_root)
    return results


def _underflow_part(args, log_root):
    from tf_als._src.demo import datasets

    data = datasets.load(args.dataset, args.data_path)
    if args.quick:
        args.epochs = 2
        data = datasets.Dataset(
            data.name, data.x_train[:256], data.y_train[:256],
            data.x_test[:128], data.y_test[:128], data.classes,
        )
    print(
        f"underflow: {args.model} on {data.name}, {len(data.x_train)} "
        f"training and {len(data.x_test)} test samples, {args.epochs} "
        f"epochs, batch {args.batch_size}", flush=True,
    )
    initial = _initial_weights(
        lambda: models.build_model(args.model, data.x_train.shape[1:], data.classes), args
    )
    results, history = {}, None
    for run in tables.RUNS:
        results[run], run_history = run_underflow(run, data, initial, args, log_root)
        history = run_history or history
        print(tables.progress("underflow", run, results[run]), flush=True)
    return results, history


def _failure_part(args, log_root):
    from tf_als._src.demo import datasets

    data = datasets.prices(seed=args.seed)
    epochs = 2 if args.quick else FAILURE_EPOCHS
    print(
        f"failure: price regression, {len(data.x_train)} training and "
        f"{len(data.x_test)} test houses, {epochs} epochs, batch {PRICE_BATCH}",
        flush=True,
    )
    initial = _initial_weights(lambda: models.build_price_model(data.x_train.shape[1]), args)
    results = {}
    for run in tables.RUNS:
        results[run] = run_failure(run, data, initial, args, log_root, epochs)
        print(tables.progress("failure", run, results[run]), flush=True)
    return results


def _write(args, results, texts, history, log_root):
    """Writes the tables, the JSON and the plot, and prints the tables,
    what they show and where everything went."""
    import keras

    from tf_als._src.monitoring import plots

    keras.mixed_precision.set_global_policy("float32")
    plot_path = None
    if history is not None:
        plot_path = os.path.join(args.output_dir, "tf_als_scales.png")
        plots.plot_history(history, plot_path)
    results_md = os.path.join(args.output_dir, "results.md")
    with open(results_md, "w") as handle:
        handle.write("\n\n".join(table for table, _ in texts) + "\n")
    with open(os.path.join(args.output_dir, "results.json"), "w") as handle:
        json.dump({"args": vars(args), "results": results}, handle, indent=2)
    for table, summary in texts:
        print(f"\n{table}\n\n{summary}")
    print(f"\nTables: {results_md} (and results.json)")
    print(f"TensorBoard: tensorboard --logdir {log_root}")
    if plot_path:
        print(f"tf_als's per-layer scales over the underflow run: {plot_path}")


if __name__ == "__main__":
    main(sys.argv[1:])
