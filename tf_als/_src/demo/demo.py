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
import types
import warnings

_TF_ALS_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = ("deep-sigmoid", "cnn", "sigmoid-mlp")
RUNS = ("float32", "keras", "tf_als")
PARTS = ("underflow", "failure")
RUN_TITLES = types.MappingProxyType({
    "float32": "float32",
    "keras": "float16, Keras LossScaleOptimizer",
    "tf_als": "float16, tf_als",
})


# The demo trains a few hundred steps: with Keras's default momentum 0.99
# the moving statistics that evaluation uses would still be far from the
# data's (measured: 100% train, 18% test accuracy after 230 steps).
BN_MOMENTUM = 0.9


# Depth of `deep-sigmoid`: at 16 layers its trained gradients fit one
# global scale again (Keras flushes 11% of the first layer's elements, with
# 3% error); at 20, 79% (measured on digits, seed 0).
DEEP_SIGMOID_LAYERS = 20

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

# How close tf_als's held-out result must come to float32's for the
# closing sentences to call it "float32's": the demo's test asserts it too.
ACCURACY_TOLERANCE = 0.02  # digits: test accuracy, absolute
R2_TOLERANCE = 0.01  # prices: test R2, absolute


def build_model(name, input_shape, classes):
    """The underflow part's models.

    - `deep-sigmoid`: 20 sigmoid Dense layers of 64 units, each reading the
      previous layer's output and the input (dense input connections, as
      DenseNet reads all earlier features). Through the input connections it
      trains like a shallow network (about 95% test accuracy on digits in
      float32), while the gradients of its first layers still pass through
      up to 20 sigmoids, each of which at least quarters them: they span
      more than float16's range.
    - `cnn`: a small convolutional network with batch normalisation, whose
      gradients one global scale serves.
    - `sigmoid-mlp`: 16 plain sigmoid Dense layers, the textbook
      vanishing-gradient network (it hardly trains, in float32 too).
    """
    import keras

    layers = keras.layers
    inputs = keras.Input(input_shape)
    if name == "deep-sigmoid":
        flat = layers.Flatten()(inputs)
        x = layers.Dense(64, activation="sigmoid", name="sigmoid_1")(flat)
        for depth in range(2, DEEP_SIGMOID_LAYERS + 1):
            x = layers.Concatenate()([x, flat])
            x = layers.Dense(64, activation="sigmoid", name=f"sigmoid_{depth}")(x)
    elif name == "sigmoid-mlp":
        x = layers.Flatten()(inputs)
        for _ in range(16):
            x = layers.Dense(64, activation="sigmoid")(x)
    else:
        x = inputs
        for filters in (16, 32):
            x = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
            x = layers.BatchNormalization(momentum=BN_MOMENTUM)(x)
            x = layers.ReLU()(x)
        x = layers.MaxPooling2D()(x)
        x = layers.Conv2D(32, 3, padding="same", use_bias=False)(x)
        x = layers.BatchNormalization(momentum=BN_MOMENTUM)(x)
        x = layers.ReLU()(x)
        x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name=name.replace("-", "_"))


def build_price_model(features):
    """The failure part's model: two ReLU Dense layers and `price`, a
    Dense(1) output in the global policy's compute dtype (float16 under
    mixed_float16, as Keras builds it unless told otherwise)."""
    import keras

    inputs = keras.Input((features,))
    x = keras.layers.Dense(32, activation="relu", name="hidden_1")(inputs)
    x = keras.layers.Dense(16, activation="relu", name="hidden_2")(x)
    outputs = keras.layers.Dense(1, name="price")(x)
    return keras.Model(inputs, outputs, name="prices")


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
    model = _fresh(run, lambda: build_model(args.model, data.x_train.shape[1:], data.classes), args)
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
    model = _fresh(run, lambda: build_price_model(data.x_train.shape[1]), args)
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
        "test_r2": r2(data.y_test, predictions),
        "steps": counter.batches,
        "skipped_steps": counter.skipped,
        "loss_scale": _scale(run, optimizer),
        "promoted": promoted,
        "seconds": time.perf_counter() - began,
        "warnings": messages,
    }


def r2(y, predictions):
    """The coefficient of determination, 1 - SS_res / SS_tot, in float64;
    NaN when a prediction is not finite."""
    import numpy as np

    y = np.asarray(y, "float64")
    predictions = np.asarray(predictions, "float64")
    if not np.all(np.isfinite(predictions)):
        return float("nan")
    return float(1.0 - np.sum((y - predictions) ** 2) / np.sum((y - y.mean()) ** 2))


def progress(part, run, result):
    """One line for a finished run."""
    head = f"{part:<9} {RUN_TITLES[run]:<34} done in {result['seconds']:4.0f} s, "
    if part == "underflow":
        line = head + f"test accuracy {result['test_accuracy']:.3f}"
        return line + _said(result)
    line = head + f"test R2 {_r2_text(result['test_r2'])}"
    if result["skipped_steps"]:
        line += f", {result['skipped_steps']} of {result['steps']} steps skipped"
    if result["promoted"]:
        line += f", promoted to float32: {', '.join(result['promoted'])}"
    return line + _said(result)


def _said(result):
    """The first sentence of each of tf_als's warnings, a line each (the
    whole messages are in results.json)."""
    return "".join(
        f"\n    tf_als said: {message.split('. ')[0].rstrip('.')}."
        for message in result["warnings"]
    )


def _r2_text(value):
    return f"{value:.4f}" if math.isfinite(value) else "not finite"


def _pow2(value):
    if value <= 0:
        return "0"
    exponent = math.log2(value)
    return f"2**{exponent:.0f}" if exponent == round(exponent) else f"{value:g}"


def underflow_table(results):
    """Part 1's Markdown table."""
    lines = [
        "| run | test accuracy | test loss | worst layer | its underflow | "
        "its gradient error | skipped steps | CPU time a step vs Keras |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    base = results["keras"]["step_seconds"]
    for run in RUNS:
        r = results[run]
        lines.append(
            f"| {RUN_TITLES[run]} | {r['test_accuracy']:.4f} | {r['test_loss']:.4f} | "
            f"{r['worst_layer'] or '-'} | {r['worst_underflow']:.1%} | "
            f"{r['worst_gradient_error']:.1%} | {r['skipped_steps']} of {r['steps']} | "
            f"{r['step_seconds'] / base:.2f}x |"
        )
    return "\n".join(lines)


def failure_table(results):
    """Part 2's Markdown table."""
    lines = [
        "| run | test R2 | skipped steps | final loss scale | layers promoted to float32 |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for run in RUNS:
        r = results[run]
        lines.append(
            f"| {RUN_TITLES[run]} | {_r2_text(r['test_r2'])} | "
            f"{r['skipped_steps']} of {r['steps']} | "
            f"{_pow2(r['loss_scale']) if run != 'float32' else '-'} | "
            f"{', '.join(r['promoted']) or '-'} |"
        )
    return "\n".join(lines)


def underflow_summary(results):
    """What part 1's table shows, from its own numbers."""
    keras_run, als = results["keras"], results["tf_als"]
    layer = keras_run["worst_layer"]
    underflow, error = keras_run["layers"][layer]
    als_underflow, als_error = als["layers"][layer]
    accuracies = [results[run]["test_accuracy"] for run in RUNS]
    spread = max(accuracies) - min(accuracies)
    accuracy = (
        f"Test accuracy differs by {spread:.1%} at most between the three "
        "runs: on this model the lost gradients do not change the result."
        if spread <= ACCURACY_TOLERANCE
        else f"Test accuracy: float32 {accuracies[0]:.3f}, Keras "
        f"{accuracies[1]:.3f}, tf_als {accuracies[2]:.3f}."
    )
    return (
        f"Underflow: the worst layer under Keras's global scale "
        f"({_pow2(keras_run['loss_scale'])}) is {layer}: {underflow:.0%} of its "
        f"weight-gradient elements that float32 resolves arrive as exact "
        f"zeros (underflow) and the gradient applied is {error:.0%} off "
        f"float32's (gradient error: |g16 - g32| / |g32| over the layer's "
        f"weights; both at each run's final weights, mean of 4 held-out "
        f"batches). With its own scale under tf_als the same layer has "
        f"{als_underflow:.1%} and {als_error:.1%}. {accuracy}"
    )


def failure_summary(results):
    """What part 2's table shows, from its own numbers."""
    f32, keras_run, als = results["float32"], results["keras"], results["tf_als"]
    ended = (
        "its predictions are not finite"
        if not math.isfinite(keras_run["test_r2"])
        else f"its test R2 is {keras_run['test_r2']:.4f}"
    )
    promoted = ", ".join(als["promoted"]) or "no layer"
    return (
        f"Failure: every price is above 65504, float16's largest value, so "
        f"no loss scale helps the float16 output layer. Keras skipped "
        f"{keras_run['skipped_steps']} of {keras_run['steps']} steps, its "
        f"scale fell to {_pow2(keras_run['loss_scale'])} and {ended}. tf_als "
        f"promoted {promoted} to float32, skipped {als['skipped_steps']} "
        f"steps and reached a test R2 of {_r2_text(als['test_r2'])} "
        f"(float32: {_r2_text(f32['test_r2'])})."
    )


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
        help="Keras fit verbosity: 0 one line per run (default), 1 progress "
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
        texts.append((underflow_table(results["underflow"]), underflow_summary(results["underflow"])))
    if "failure" in parts:
        results["failure"] = _failure_part(args, log_root)
        texts.append((failure_table(results["failure"]), failure_summary(results["failure"])))
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
        lambda: build_model(args.model, data.x_train.shape[1:], data.classes), args
    )
    results, history = {}, None
    for run in RUNS:
        results[run], run_history = run_underflow(run, data, initial, args, log_root)
        history = run_history or history
        print(progress("underflow", run, results[run]), flush=True)
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
    initial = _initial_weights(lambda: build_price_model(data.x_train.shape[1]), args)
    results = {}
    for run in RUNS:
        results[run] = run_failure(run, data, initial, args, log_root, epochs)
        print(progress("failure", run, results[run]), flush=True)
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
