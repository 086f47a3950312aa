"""What an eager forward pass under a gradient tape holds, next to one
without a tape and a traced training step: the resident set a fresh
process gains, in MiB, on a plain model of `overhead.py` (no tf_als).

tf_als's first-batch check runs its forward pass eagerly under a
persistent tape (`backward_search.Forward`); this shows what that costs
the process's peak whatever tf_als does with it.

    python benchmarks/eager_tape_memory.py --model gpt2_mid --batch 32

Each mode runs in its own process (`--mode` runs one): `no_tape` (an eager
forward pass), `tape` (the same under a persistent `tf.GradientTape`, then
the weights' gradients) and `traced` (forward and backward in one
`tf.function`, as a training step without XLA).
"""

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODES = ("no_tape", "tape", "traced")


def worker(model_name: str, batch: int, mode: str) -> dict:
    import keras
    import tensorflow as tf

    import overhead

    keras.mixed_precision.set_global_policy("mixed_float16")
    model, loss, x, y, batch = overhead.build(model_name, 4, batch)
    built = overhead._rss_mib()
    if mode == "no_tape":
        model(x, training=True)
    elif mode == "tape":
        with tf.GradientTape(persistent=True) as tape:
            value = loss(y, model(x, training=True))
        tape.gradient(value, model.trainable_weights)
    else:

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                value = loss(y, model(x, training=True))
            return tape.gradient(value, model.trainable_weights)

        step(x, y)
    return {"mode": mode, "gained": overhead._rss_mib() - built}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2_mid")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode:
        print(json.dumps(worker(args.model, args.batch, args.mode)))
        return
    print(f"{args.model}, batch {args.batch}: resident set gained after the model is built (MiB)")
    print("| mode | gained |")
    print("| --- | ---: |")
    for mode in MODES:
        done = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--batch", str(args.batch),
             "--mode", mode],
            capture_output=True, text=True, check=True,
        )
        row = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"| {row['mode']} | {row['gained']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
