"""What the first-batch check costs on a healthy composite-heavy model: its
wall time, the eager backward passes and float32 re-runs it makes, and the
same in steps of Keras's own compiled train step on the same batch.

Models (random weights, `mixed_float16`, nothing downloaded):

- `gpt2`: `benchmarks/op_count.py`'s KerasHub GPT-2 backbone (4 layers,
  hidden 256, 128 tokens, batch 2) under a float32 Dense head. Its
  composites are KerasHub's, whose finite float16 outputs the check takes
  as they are.
- `blocks`: `tests/failure_cases.py`'s character GPT with its attention in
  user-written composites (`DecoderBlock`, `CausalSelfAttention`), the
  thread's 1e4 mask (healthy): every composite is re-run in float32.

Each check runs `--repeats` times on a fresh instrumented model (the first
includes one-off costs and is reported apart). The Keras step is the median
of 20 compiled `train_on_batch` calls after a warm-up, without XLA.

    python benchmarks/search_cost.py                    # ~2 min on 2 CPU cores
    python benchmarks/search_cost.py --models blocks --repeats 3
"""

import argparse
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

MODELS = ("gpt2", "blocks")


def build(name):
    """(plain model, loss, x, y) under mixed_float16."""
    import keras

    keras.mixed_precision.set_global_policy("mixed_float16")
    if name == "gpt2":
        import op_count

        return op_count.build("gpt2")
    from tests import failure_cases

    case = failure_cases.REPORTED["gpt2_mask_block"]
    keras.utils.set_random_seed(0)
    batches, _ = case.data(0)
    x, y = batches[0]
    return case.build(True), case.loss, x, y


class Counts:
    """Counts the check's backward passes and float32 re-runs by wrapping
    the two functions that make them, for the block."""

    def __init__(self):
        from tf_als._src.failures import backward_search
        from tf_als._src.failures import preflight

        self.backward = self.reruns = 0
        self._patched = [
            (backward_search.Forward, "_backward", "backward"),
            (preflight, "_stray", "reruns"),
        ]

    def __enter__(self):
        self._originals = []
        for owner, name, counter in self._patched:
            original = getattr(owner, name)
            self._originals.append((owner, name, original))

            def counted(*args, _original=original, _counter=counter, **kwargs):
                setattr(self, _counter, getattr(self, _counter) + 1)
                return _original(*args, **kwargs)

            setattr(owner, name, counted)
        return self

    def __exit__(self, *exc):
        for owner, name, original in self._originals:
            setattr(owner, name, original)


def keras_step(name):
    """Median seconds of Keras's compiled train step (no XLA) on the batch."""
    import keras

    model, loss, x, y = build(name)
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3)),
        loss=loss, jit_compile=False,
    )
    for _ in range(3):
        model.train_on_batch(x, y)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def check(name):
    """(seconds, backward passes, re-runs, promotions) of one first-batch
    check on a fresh instrumented model."""
    import tf_als
    from tf_als._src.failures import preflight

    model, loss, x, y = build(name)
    instrumented = tf_als.instrument(model)
    loss_fn = preflight.batch_mean_loss(loss)
    with Counts() as counts:
        start = time.perf_counter()
        outcome = preflight.check(instrumented, (x, y, None), loss_fn, 2.0**15, 0)
        seconds = time.perf_counter() - start
    return seconds, counts.backward, counts.reruns, len(outcome.promotions)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print("| model | Keras step (ms) | check, first (s) | check, later (s) "
          "| backward passes | float32 re-runs | promoted | check in Keras steps |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.models:
        step = keras_step(name)
        runs = [check(name) for _ in range(args.repeats)]
        later = float(np.median([r[0] for r in runs[1:]])) if len(runs) > 1 else runs[0][0]
        _, backward, reruns, promoted = runs[-1]
        print(f"| {name} | {step * 1e3:.1f} | {runs[0][0]:.2f} | {later:.2f} | {backward} "
              f"| {reruns} | {promoted} | {later / step:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
