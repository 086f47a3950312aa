"""The main job: one model trained three ways on a real dataset.

    python -m tf_als.demo            # about 3 minutes on 2 CPU cores
    python -m tf_als.demo --quick    # a few seconds of training, for tests

Trains the same model (same initial weights, same batches) in float32, in
mixed_float16 with Keras's `LossScaleOptimizer`, and in mixed_float16 with
tf_als, then prints a results table: test accuracy and loss; at the final
weights, on held-out batches, the worst layer's weight-gradient underflow
(the share of elements that are zero where float32's are not) and its
relative gradient error against float32 (`tf_als.diagnose`); skipped steps;
step time relative to Keras's run. It writes TensorBoard logs
(`tensorboard --logdir <output-dir>/tensorboard`), a PNG of tf_als's
per-layer scales, and the table as Markdown and JSON.

The default model, `deep-sigmoid`, trains well in float32 while its first
layers' gradients fall below what one global loss scale can hold in
float16; `--model cnn` is the well-conditioned case, where every run
agrees.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = ("deep-sigmoid", "cnn", "sigmoid-mlp")
RUNS = ("float32", "keras", "tf_als")
RUN_TITLES = {
    "float32": "float32",
    "keras": "float16, Keras LossScaleOptimizer",
    "tf_als": "float16, tf_als",
}


# The demo trains a few hundred steps: with Keras's default momentum 0.99
# the moving statistics that evaluation uses would still be far from the
# data's (measured: 100% train, 18% test accuracy after 230 steps).
BN_MOMENTUM = 0.9


# Depth of `deep-sigmoid`: at 16 layers its trained gradients fit one
# global scale again (Keras flushes 11% of the first layer's elements, with
# 3% error); at 20, 79% (measured on digits, seed 0).
DEEP_SIGMOID_LAYERS = 20


def build_model(name, input_shape, classes):
    """The demo models.

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


class _StepTimer:
    """Keras callback factory: wall time of each epoch after the first
    (which includes compilation), and steps that were skipped."""

    def __new__(cls):
        import keras

        class StepTimer(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.epoch_times, self.steps, self.skipped = [], 0, 0

            def on_epoch_begin(self, epoch, logs=None):
                self._began = time.perf_counter()
                self._applied_before = self._read_iterations()
                self._batches = 0

            def on_train_batch_end(self, batch, logs=None):
                self._batches += 1

            def on_epoch_end(self, epoch, logs=None):
                seconds = time.perf_counter() - self._began
                if epoch > 0:
                    self.epoch_times.append(seconds)
                    self.steps += self._batches
                applied = self._read_iterations() - self._applied_before
                self.skipped += self._batches - applied

            def _read_iterations(self):
                return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

        return StepTimer()


def train(run, args, data, initial_weights, log_root):
    """Trains one run; returns (model, results dict, ScaleHistory or None)."""
    import keras

    keras.mixed_precision.set_global_policy("float32" if run == "float32" else "mixed_float16")
    keras.utils.set_random_seed(args.seed)
    model = build_model(args.model, data.x_train.shape[1:], data.classes)
    model.set_weights(initial_weights)
    model, optimizer, history = _scaling(run, model, args, log_root)
    timer = _StepTimer()
    callbacks = [keras.callbacks.TensorBoard(os.path.join(log_root, run)), timer]
    if history is not None:
        callbacks.insert(0, history)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    print(f"\n== {RUN_TITLES[run]} ==", flush=True)
    model.fit(
        data.x_train,
        data.y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        verbose=args.verbose,
        callbacks=callbacks,
        shuffle=False,
    )
    loss, accuracy = model.evaluate(data.x_test, data.y_test, verbose=0)
    step_time = sum(timer.epoch_times) / max(timer.steps, 1)
    return model, {
        "test_accuracy": float(accuracy),
        "test_loss": float(loss),
        "skipped_steps": int(timer.skipped),
        "step_seconds": step_time,
    }, history


def _scaling(run, model, args, log_root):
    """(the model to train, its optimizer, a ScaleHistory or None) for run
    `run`: plain Adam, Keras's loss scaling, or tf_als."""
    import keras

    import tf_als

    inner = keras.optimizers.Adam(args.learning_rate)
    if run == "float32":
        return model, inner, None
    if run == "keras":
        return model, keras.optimizers.LossScaleOptimizer(inner), None
    model = tf_als.instrument(model)
    optimizer = tf_als.AdaptiveLossScaleOptimizer(inner, telemetry_interval=args.telemetry_interval)
    history = tf_als.callbacks.ScaleHistory(log_dir=os.path.join(log_root, run))
    return model, optimizer, history


def precision(run, model, data, args, batches=4):
    """(worst underflow, worst relative error) of the run's weight
    gradients against float32, at its final weights: per layer, the mean
    over `batches` held-out batches of `tf_als.diagnose`'s flushed share and
    relative error, then the worst layer. Zero for the float32 run."""
    import keras
    import numpy as np

    import tf_als

    if run == "float32":
        return 0.0, 0.0
    kind = "keras" if run == "keras" else "als"
    underflow, error = [], []
    for start in range(0, batches * args.batch_size, args.batch_size):
        x = data.x_test[start : start + args.batch_size]
        y = data.y_test[start : start + args.batch_size]
        if len(x) == 0:
            break
        report = tf_als.diagnose(
            model,
            x,
            y,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            verbose=False,
        )
        underflow.append([getattr(r, f"{kind}_underflow") for r in report.rows])
        error.append([getattr(r, f"{kind}_error") for r in report.rows])
    return (
        float(np.max(np.mean(underflow, axis=0))),
        float(np.max(np.mean(error, axis=0))),
    )


def table(results):
    lines = [
        "| run | test accuracy | test loss | worst-layer underflow | "
        "worst-layer gradient error | skipped steps | step time vs Keras |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = results["keras"]["step_seconds"]
    for run in RUNS:
        r = results[run]
        lines.append(
            f"| {RUN_TITLES[run]} | {r['test_accuracy']:.4f} | {r['test_loss']:.4f} | "
            f"{r['worst_underflow']:.1%} | {r['worst_gradient_error']:.1%} | "
            f"{r['skipped_steps']} | "
            f"{r['step_seconds'] / base:.2f}x |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tf_als.demo",
        description="Train one model in float32, in float16 with Keras's "
        "LossScaleOptimizer and in float16 with tf_als, and compare them.",
    )
    parser.add_argument("--model", choices=MODELS, default="deep-sigmoid",
                        help="deep-sigmoid (default): 20 sigmoid layers that "
                        "also read the input; it trains well, and its first "
                        "layers' gradients span more than one float16 loss "
                        "scale can hold. cnn: a small conv net with batch "
                        "normalisation, which one global scale serves. "
                        "sigmoid-mlp: 16 plain sigmoid layers (the textbook "
                        "vanishing-gradient network; it barely trains, in "
                        "float32 too)")
    parser.add_argument("--dataset", choices=("digits", "mnist"), default="digits",
                        help="digits ships with scikit-learn (default); mnist "
                        "reads a local mnist.npz (see --data-path)")
    parser.add_argument("--data-path", default=None,
                        help="mnist.npz for --dataset mnist (default "
                        "~/.keras/datasets/mnist.npz); never downloaded")
    parser.add_argument("--epochs", type=int, default=20,
                        help="training epochs per run (default 20)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="batch size (default 64)")
    parser.add_argument("--learning-rate", type=float, default=1e-3,
                        help="Adam learning rate (default 1e-3)")
    parser.add_argument("--telemetry-interval", type=int, default=100,
                        help="steps between tf_als telemetry records (default 100)")
    parser.add_argument("--output-dir", default="tf_als_runs",
                        help="where logs, plot and results go (default ./tf_als_runs)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--quick", action="store_true",
                        help="2 epochs on 256 training samples, for tests")
    parser.add_argument("--verbose", type=int, choices=(0, 1, 2), default=1,
                        help="Keras fit verbosity: 0 silent, 1 progress bars "
                        "(default), 2 one line per epoch")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "telemetry_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if not args.learning_rate > 0:
        parser.error(f"--learning-rate must be > 0; got {args.learning_rate}")
    return args


def main(argv=None):
    args = parse_args(argv)
    import keras

    from tf_als._src.demo import datasets
    from tf_als._src.monitoring import plots

    data = datasets.load(args.dataset, args.data_path)
    if args.quick:
        args.epochs = 2
        data = datasets.Dataset(
            data.name, data.x_train[:256], data.y_train[:256],
            data.x_test[:128], data.y_test[:128], data.classes,
        )
    os.makedirs(args.output_dir, exist_ok=True)
    log_root = os.path.join(args.output_dir, "tensorboard")
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(args.seed)
    initial = build_model(args.model, data.x_train.shape[1:], data.classes).get_weights()

    results = {}
    history = None
    for run in RUNS:
        model, results[run], run_history = train(run, args, data, initial, log_root)
        underflow, error = precision(run, model, data, args)
        results[run].update(worst_underflow=underflow, worst_gradient_error=error)
        history = run_history or history
    keras.mixed_precision.set_global_policy("float32")

    plot_path = os.path.join(args.output_dir, "tf_als_scales.png")
    plots.plot_history(history, plot_path)
    text = table(results)
    with open(os.path.join(args.output_dir, "results.md"), "w") as handle:
        handle.write(text + "\n")
    with open(os.path.join(args.output_dir, "results.json"), "w") as handle:
        json.dump({"args": vars(args), "results": results}, handle, indent=2)
    print(
        f"\n{args.model} on {data.name}: {len(data.x_train)} training and "
        f"{len(data.x_test)} test samples, {args.epochs} epochs, batch "
        f"{args.batch_size}\n"
    )
    print(text)
    print(
        f"\nTensorBoard: tensorboard --logdir {log_root}\n"
        f"Per-layer scales: {plot_path}\n"
        f"Results: {os.path.join(args.output_dir, 'results.md')}"
    )
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
