"""One table of what tf_als costs next to Keras's LossScaleOptimizer, for a
GPU (it runs on a CPU too, at a smaller size).

    python benchmarks/gpu_check.py            # ~5 minutes on one GPU
    python benchmarks/gpu_check.py --quick    # a one-block CNN, few steps (the suite)

For each model and XLA off and on, it runs `benchmarks/overhead.py`'s
workers: one process trains Keras's `LossScaleOptimizer` and tf_als side by
side from the same weights on the same batches, in alternating chunks, and
times every step; then a fresh process per optimizer times the first `fit`
call (trace, compile, one step) and records the peak memory: the GPU's own
(`tf.config.experimental.get_memory_info`) when there is one, the process's
resident set on a CPU. Columns (ratios, tf_als / Keras):

- step: tf_als's median step with its telemetry every 100 steps (the
  default): every scale is chosen on every step, in the backward pass;
- step, telemetry every step: `telemetry_interval=1`;
- set-up: the first `fit` call, without tf_als's first-batch check, which
  it runs once (`overhead.py` reports the check's own time in steps);
- peak memory.

The design targets are 1.03, 1.25, 1.3 and 1.05 (issue 38's goals;
docs/performance.md).
Models: the residual CNN and a 4-layer GPT-2 of hidden size 256 on a GPU;
the residual CNN and the tiny GPT-2 on a CPU.
"""

import argparse
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = {"step": 1.03, "step_every": 1.25, "setup": 1.3, "memory": 1.05}
# (batch, chunk, rounds) per model, on a GPU and on a CPU.
GPU_SIZES = {"cnn": (64, 50, 3), "gpt2_mid": (16, 50, 3)}
CPU_SIZES = {"cnn": (8, 10, 2), "gpt2": (None, 20, 2)}
QUICK_SIZES = {"cnn": (4, 6, 1)}
# The quick check's CNN has one residual block (the test suite runs it to
# see that every worker and column works, not to measure).
QUICK_BLOCKS = 1


def _overhead():
    spec = importlib.util.spec_from_file_location(
        "tf_als_overhead", os.path.join(HERE, "overhead.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def has_gpu() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def check(model, xla, batch, chunk, rounds, overhead, blocks=4):
    """One row: the four ratios for `model` with XLA `xla` ("off"/"on");
    `blocks`: the residual CNN's."""
    base = [
        "--chunk", str(chunk), "--rounds", str(rounds), "--model", model,
        "--xla", xla, "--blocks", str(blocks),
    ] + ([] if batch is None else ["--batch", str(batch)])
    timed = overhead._run_worker("--worker", "time", *base)
    summary = overhead.summarise(timed)
    fresh = {
        v: overhead._run_worker("--worker", "fresh", "--variant", v, *base)
        for v in ("keras", "tf_als")
    }
    memory = "device_peak" if fresh["keras"].get("device_peak") else "peak"
    return {
        "model": model,
        "xla": xla,
        "batch": batch,
        "keras_ms": summary["keras_ms"],
        "step": summary["interval_100"],
        "step_every": summary["interval_1"],
        "setup": fresh["tf_als"]["setup"] / fresh["keras"]["setup"],
        "memory": fresh["tf_als"][memory] / fresh["keras"][memory],
        "memory_kind": "device" if memory == "device_peak" else "process RSS",
    }


def table(rows) -> str:
    header = (
        "| model | XLA | batch | Keras step (ms) | step | step, telemetry "
        "every step | set-up | peak memory |"
    )
    lines = [header, "|" + " --- |" * 8]
    for row in rows:
        cells = [row["model"], row["xla"], str(row["batch"] or "-"),
                 f"{row['keras_ms']:.1f}"]
        for key in ("step", "step_every", "setup", "memory"):
            mark = "" if row[key] <= TARGETS[key] else " (over)"
            cells.append(f"{row[key]:.3f}{mark}")
        lines.append("| " + " | ".join(cells) + " |")
    targets = ", ".join(f"{k} {v}" for k, v in TARGETS.items())
    kind = rows[0]["memory_kind"] if rows else "-"
    return "\n".join(lines) + f"\n\nTargets: {targets}. Peak memory: {kind}."


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="the residual CNN at a tiny size (for the test suite)")
    parser.add_argument("--xla", default="off,on")
    args = parser.parse_args(argv)
    overhead = _overhead()
    gpu = has_gpu()
    sizes = QUICK_SIZES if args.quick else GPU_SIZES if gpu else CPU_SIZES
    print(f"device: {'GPU' if gpu else 'CPU'}", flush=True)
    rows = []
    for model, (batch, chunk, rounds) in sizes.items():
        for xla in args.xla.split(","):
            blocks = QUICK_BLOCKS if args.quick else 4
            rows.append(check(model, xla, batch, chunk, rounds, overhead, blocks))
            print(table(rows[-1:]).splitlines()[2], flush=True)
    print("\n" + table(rows))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
