"""A run whose float16 forward pass overflows: float32, Keras's
`LossScaleOptimizer`, and tf_als with `promote_on_storm` (its default).

The model is `tests/test_promote.py`'s: first -> hot -> head, where `hot` is
a Dense with a softmax whose logits carry a common offset of 1e5 (softmax
ignores it; float16 cannot hold it). The runs start from the same weights
and see the same batches; a fourth trains float32 for only as many steps
as tf_als applied. For each it prints and writes
(`benchmarks/results/promotion.md` and `.json`): steps applied and lost,
the final loss on the training data, and for tf_als the step of the
promotion and the wall time of the batch that retraced the train function,
next to the median batch.

    python benchmarks/promotion.py            # ~1 min on 2 CPU cores
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

STEPS = 200
BATCH = 16
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def build(keras, policy):
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, name="first")(inputs)
    x = keras.layers.Dense(16, activation="softmax", name="hot")(x)
    outputs = keras.layers.Dense(4, dtype="float32", name="head")(x)
    model = keras.Model(inputs, outputs)
    hot = model.get_layer("hot")
    hot.bias.assign([1e5] * 16)
    return model


def data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * 8, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + 2 * (x[:, 1] > 0).astype("int32")
    return x, y


def run(variant, steps=STEPS):
    import keras
    import numpy as np

    import tf_als

    model = build(keras, "mixed_float16" if variant in ("keras", "tf_als") else "float32")
    inner = keras.optimizers.Adam(1e-2)
    optimizer = {
        "float32": lambda: inner,
        "float32, tf_als's applied steps": lambda: inner,
        "keras": lambda: keras.optimizers.LossScaleOptimizer(inner),
        "tf_als": lambda: tf_als.AdaptiveLossScaleOptimizer(inner),
    }[variant]()
    if variant == "tf_als":
        model = tf_als.instrument(model)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    times = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.began = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.began)

    x, y = data()
    epochs = steps * BATCH // len(x)
    # An instrumented model's fit adds its guard after the timer: the
    # promotion and the retrace it asks for land in the next batch's time.
    model.fit(
        x, y, batch_size=BATCH, epochs=epochs, verbose=0, shuffle=False,
        callbacks=[Timer()],
    )
    applied = int(keras.ops.convert_to_numpy(getattr(optimizer, "iterations")))
    result = {
        "variant": variant,
        "steps": len(times),
        "applied": applied,
        "lost": len(times) - applied,
        "final_loss": float(model.evaluate(x, y, verbose=0)),
        "median_batch_seconds": float(np.median(times[2:])),
    }
    if variant == "tf_als":
        (promotion,) = tf_als.promoted(model)
        result.update(
            promoted=promotion.layer,
            promotion_step=promotion.step,
            # Batches 0..k-1 were skipped; the guard promoted after batch
            # k-1, so batch k retraced.
            retrace_batch_seconds=times[result["lost"]],
        )
    return result


def table(results):
    lines = [
        "| run | steps | applied | lost | final loss | median batch (s) | retrace batch (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        retrace = r.get("retrace_batch_seconds")
        lines.append(
            f"| {r['variant']} | {r['steps']} | {r['applied']} | {r['lost']} | "
            f"{r['final_loss']:.4f} | {r['median_batch_seconds']:.4f} | "
            f"{'-' if retrace is None else f'{retrace:.2f}'} |"
        )
    return "\n".join(lines)


def main():
    import warnings

    warnings.simplefilter("ignore", UserWarning)
    results = [run(v) for v in ("float32", "keras", "tf_als")]
    # float32 trained for as many steps as tf_als applied (the batches are
    # the same every epoch, and tf_als lost whole epochs).
    results.append(run("float32, tf_als's applied steps", results[2]["applied"]))
    text = table(results)
    promoted = results[2]
    text += (
        f"\n\ntf_als promoted {promoted['promoted']!r} at step "
        f"{promoted['promotion_step']} (after {promoted['lost']} skipped "
        "steps: max_consecutive_skips).\n"
    )
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "promotion.md"), "w") as handle:
        handle.write(text)
    with open(os.path.join(RESULTS, "promotion.json"), "w") as handle:
        json.dump(results, handle, indent=2)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
