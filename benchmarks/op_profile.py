"""Where tf_als's extra step time goes: compute time per op type, from
TensorFlow's profiler, tf_als against Keras's LossScaleOptimizer.

`benchmarks/overhead.py` says how much longer a step takes; this says which
ops take it. For one model of `overhead.py` (same builds, same batches),
without XLA, both variants (`keras`, and `tf_als` without a scale update
in the profiled steps) are built and warmed up, then `--rounds` times each
runs `--steps` steps of `fit` under `tf.profiler`, in turn. The profile's
executor threads give every op's compute time; they are summed per op type
(Cast, Mul, MatMul...) and per step, over all threads (so on 2 cores a
step's op time is up to twice its wall time: ops on the two threads
overlap). The table lists the op types whose time or count differs most.
There is no XLA mode: with XLA the step is one compiled cluster, whose
fusions the profile names but does not map back to ops.

    python benchmarks/op_profile.py --model gpt2_mid          # ~1 min
    python benchmarks/op_profile.py --model cnn --steps 4

Results go to `benchmarks/results/op_profile_<model>.md`.
"""

import argparse
import collections
import glob
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overhead  # noqa: E402  (the models and data of the overhead benchmark)

VARIANTS = ("keras", "tf_als")


def build(variant, model_name, batch, warmup):
    """(model, data): a variant of `overhead.py`'s model, warmed up."""
    import tensorflow as tf

    # An update interval longer than the run: the profiled steps are the
    # steps between updates, which is what a user pays most of the time.
    model, x, y, batch = overhead.make(
        variant, model_name, False, 10**6, 4, tf.distribute.get_strategy(), batch
    )
    model.fit(overhead.dataset(x, y, batch, warmup), epochs=1, verbose=0)
    # A skipped step (non-finite gradients at the initial global scale)
    # leaves the step counter where it was, and tf_als's step 0 is an
    # update: step until one step has been applied.
    for _ in range(40):
        if int(model.optimizer.iterations.numpy()) >= 1:
            return model, (x, y, batch)
        model.fit(overhead.dataset(x, y, batch, 1), epochs=1, verbose=0)
    raise RuntimeError(f"{variant}: no finite step in {warmup + 40} steps")


def profile(model, data, steps, totals):
    """Runs `steps` steps under the profiler; adds each op type's compute
    time (ms) and count to `totals` (a dict of two Counters)."""
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    x, y, batch = data
    dataset = overhead.dataset(x, y, batch, steps)
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        model.fit(dataset, epochs=1, verbose=0)
        tf.profiler.experimental.stop()
        (path,) = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
    for plane in space.planes:
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            for event in line.events:
                name = names.get(event.metadata_id, "")
                # Ops are "name:type"; the executor's own events
                # ("ExecutorState::Process", spanning the ops) are not.
                if ":" not in name or "::" in name:
                    continue
                kind = name.rsplit(":", 1)[1]
                totals["time"][kind] += event.duration_ps / 1e9
                totals["count"][kind] += 1


def per_step(totals, steps):
    """{op type: (ms per step, ops per step)}."""
    return {
        kind: (totals["time"][kind] / steps, totals["count"][kind] / steps)
        for kind in totals["time"]
    }


def table(model_name, results, rows):
    keras_ops, als_ops = (results[v] for v in VARIANTS)
    kinds = set(keras_ops) | set(als_ops)

    def get(ops, kind):
        return ops.get(kind, (0.0, 0.0))

    def diff(kind):
        return get(als_ops, kind)[0] - get(keras_ops, kind)[0]

    total = {v: sum(t for t, _ in results[v].values()) for v in VARIANTS}
    lines = [
        f"{model_name}, XLA off: op time per step, summed over threads, "
        f"{total['keras']:.1f} ms (Keras) and {total['tf_als']:.1f} ms (tf_als).",
        "",
        "| op type | Keras (ms) | Keras ops | tf_als (ms) | tf_als ops | difference (ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    changed = [
        k
        for k in kinds
        if get(als_ops, k)[1] != get(keras_ops, k)[1] or abs(diff(k)) >= 0.5
    ]
    for kind in sorted(changed, key=lambda k: -abs(diff(k)))[:rows]:
        (kt, kn), (at, an) = get(keras_ops, kind), get(als_ops, kind)
        lines.append(
            f"| {kind} | {kt:.2f} | {kn:.0f} | {at:.2f} | {an:.0f} | {at - kt:+.2f} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="gpt2_mid", choices=sorted({m for m, _ in overhead.SETTINGS})
    )
    parser.add_argument("--steps", type=int, default=5, help="steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()
    for name in ("steps", "rounds", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1; received {getattr(args, name)}")

    batch = overhead.SETTINGS[(args.model, "off")][0]
    models = {v: build(v, args.model, batch, args.warmup) for v in VARIANTS}
    totals = {
        v: {"time": collections.Counter(), "count": collections.Counter()}
        for v in VARIANTS
    }
    # Alternating rounds: the machine's drift and the profiler's own start-up
    # fall on both variants alike.
    for _ in range(args.rounds):
        for variant, (model, data) in models.items():
            profile(model, data, args.steps, totals[variant])
    steps = args.steps * args.rounds
    results = {v: per_step(totals[v], steps) for v in VARIANTS}
    text = table(args.model, results, args.rows)
    print(text)
    path = os.path.join(overhead.RESULTS, f"op_profile_{args.model}.md")
    with open(path, "w") as f:
        f.write(
            f"Written by `python benchmarks/op_profile.py --model {args.model} "
            f"--steps {args.steps} --rounds {args.rounds}`."
            f"\n\n{text}\n"
        )


if __name__ == "__main__":
    main()
