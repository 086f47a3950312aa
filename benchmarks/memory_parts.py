"""Where tf_als's extra memory goes: the resident set of a fresh process per
variant, with one piece of tf_als left out at a time.

    python benchmarks/memory_parts.py --model gpt2_mid --xla on
    python benchmarks/memory_parts.py --model gpt2_mid --xla off --batch 32 \
        --variants keras,tf_als,no_check

Each variant runs in its own process, built by `overhead.make` (the same
model, batch and optimizer as `overhead.py`): one `fit` of one step (set-up:
trace, compile, run), a second one, then one of `--steps` steps. Printed
per variant, in MiB (`--batch` replaces `overhead.py`'s batch size for
the model, to see which part grows with the batch):

- after set-up: the resident set after the first two `fit` calls (glibc
  keeps what tracing and XLA's compiler freed, so this is close to the
  set-up's high-water mark);
- peak: the largest resident set seen, set-up included (`ru_maxrss`);
- after trim: the resident set once `malloc_trim(0)` has handed the free
  heap pages back: what stays live.

Variants (the pieces are left out by replacing private functions of tf_als
in the benchmark's process: a measurement, not an option of the library):

- `keras`: Keras's `LossScaleOptimizer` on the plain model;
- `tf_als`: as shipped;
- `no_check`: without the first-batch check (`promote_on_storm=False`,
  which a healthy model's run does not otherwise use);
- `no_forward`: without the per-point forward-headroom branches
  (`Choice._forward_headroom` returns the tallies of nothing);
- `no_telemetry`: without the telemetry branch of the optimizer's `apply`
  (`update.write_telemetry` does nothing);
- `neither`: without both;
- `no_gains`: without the points' gains (`update.write_gains` does
  nothing, so each point judges its received amax alone, and the
  optimizer's per-gradient read is Keras's finiteness check again).
"""

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = (
    "keras", "tf_als", "no_check", "no_forward", "no_telemetry", "neither", "no_gains",
)


def _leave_out(variant):
    """Replaces the pieces `variant` leaves out, before the model is made."""
    import tensorflow as tf

    from tf_als._src.scaling import rule
    from tf_als._src.training import choice
    from tf_als._src.training import replicas
    from tf_als._src.training import update

    if variant in ("no_forward", "neither"):
        choice.Choice._forward_headroom = lambda self, outputs: rule.forward_tallies([])
    if variant in ("no_telemetry", "neither"):
        update.write_telemetry = lambda *args: None
    if variant == "no_gains":
        update.write_gains = lambda *args: None
        replicas.amaxes = lambda grads: [
            tf.where(f, 0.0, float("inf")) for f in replicas.finite_flags(grads)
        ]


def worker(args):
    import warnings

    warnings.simplefilter("ignore")
    import tensorflow as tf

    import overhead

    _leave_out(args.variant)
    variant = "keras" if args.variant == "keras" else "tf_als"
    batch = args.batch or overhead.SETTINGS[(args.model, args.xla)][0]
    model, x, y, batch = overhead.make(
        variant, args.model, args.xla == "on", args.steps, 4,
        tf.distribute.get_strategy(), batch,
    )
    if args.variant == "no_check":
        # The knob that turns the check off everywhere: replacing
        # `optimizer.preflight` only moved it from `fit`'s start to the
        # guard's look after the first batch.
        model.optimizer.promote_on_storm = False
    start = time.perf_counter()
    model.fit(overhead.dataset(x, y, batch, 1), epochs=1, verbose=0)
    setup = time.perf_counter() - start
    model.fit(overhead.dataset(x, y, batch, 1), epochs=1, verbose=0)
    after_setup = overhead._rss_mib()
    model.fit(overhead.dataset(x, y, batch, args.steps), epochs=1, verbose=0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return dict(
        variant=args.variant, setup=setup, after_setup=after_setup, peak=peak,
        trimmed=overhead._rss_mib(),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2_mid")
    parser.add_argument("--xla", default="on", choices=("on", "off"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=None,
                        help="batch size (default: overhead.py's for the model)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(worker(args)))
        return
    batch = args.batch or "as in overhead.py"
    print(f"{args.model}, XLA {args.xla}, batch {batch}: resident set (MiB), one fresh process each")
    print("| variant | set-up (s) | after set-up | peak | after trim | peak - Keras's |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    keras_peak = None
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            parser.error(f"--variants: {variant!r} is not one of {', '.join(VARIANTS)}")
        result = subprocess.run(
            [sys.executable, __file__, "--variant", variant, "--model", args.model,
             "--xla", args.xla, "--steps", str(args.steps)]
            + (["--batch", str(args.batch)] if args.batch else []),
            capture_output=True, text=True, check=True,
        )
        row = json.loads(result.stdout.strip().splitlines()[-1])
        keras_peak = row["peak"] if variant == "keras" else keras_peak
        extra = "-" if keras_peak is None else f"{row['peak'] - keras_peak:+.0f}"
        print(
            f"| {variant} | {row['setup']:.1f} | {row['after_setup']:.0f} | "
            f"{row['peak']:.0f} | {row['trimmed']:.0f} | {extra} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
