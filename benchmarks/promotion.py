"""Runs whose float16 arithmetic fails in one layer at any loss scale:
float32, Keras's `LossScaleOptimizer`, and tf_als with `promote_on_storm`
(its default).

Two scenarios:

- forward: `tests/failures/test_promote.py`'s model, first -> hot -> head, where
  `hot` is a Dense with a softmax whose logits carry a common offset of 1e5
  (softmax ignores it; float16 cannot hold it). Adam(1e-2).
- backward: `tests/failures/test_promote_backward.py`'s model, first -> temperature
  -> norm -> head, where `temperature` divides by a learned t = 2**-8: the
  forward pass fits float16, but the gradient of t is formed through
  (-x / t) / t = x * 2**16, inf in float16 for |x| >= 1. SGD(0.1).

In each, the runs start from the same weights and see the same batches; a
fourth trains float32 for only as many steps as tf_als applied. For each it
prints and writes (`benchmarks/results/promotion.md` and `.json`): steps
applied and lost, the final loss on the training data, and for tf_als the
step of the promotion and the wall time of the batch after it (the eager
search and the retrace of the train function), next to the median batch.

    python benchmarks/promotion.py            # ~2 min on 2 CPU cores
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

STEPS = 200
BATCH = 16
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def build_forward(keras, policy):
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


def build_backward(keras, policy):
    class Temperature(keras.layers.Layer):
        """y = x / t, with a learned scalar temperature t = 2**-8."""

        def build(self, input_shape):
            self.t = self.add_weight(
                shape=(), initializer=keras.initializers.Constant(2.0**-8), name="t"
            )

        def call(self, x):
            return x / keras.ops.cast(self.t, x.dtype)

    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, name="first")(inputs)
    x = Temperature(name="temperature")(x)
    x = keras.layers.LayerNormalization(name="norm")(x)
    outputs = keras.layers.Dense(4, dtype="float32", name="head")(x)
    return keras.Model(inputs, outputs)


SCENARIOS = {
    "forward": (build_forward, lambda keras: keras.optimizers.Adam(1e-2)),
    "backward": (build_backward, lambda keras: keras.optimizers.SGD(0.1)),
}


def data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * 8, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + 2 * (x[:, 1] > 0).astype("int32")
    return x, y


def run(scenario, variant, steps=STEPS):
    import keras
    import numpy as np

    import tf_als

    build, make_inner = SCENARIOS[scenario]
    model = build(keras, "mixed_float16" if variant in ("keras", "tf_als") else "float32")
    inner = make_inner(keras)
    optimizer = {
        "float32": lambda: inner,
        "float32, tf_als's applied steps": lambda: inner,
        "keras": lambda: keras.optimizers.LossScaleOptimizer(inner),
        "tf_als": lambda: tf_als.AdaptiveLossScaleOptimizer(inner),
    }[variant]()
    if variant == "tf_als":
        model = tf_als.instrument(model)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    times, gaps = [], []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.began = time.perf_counter()
            if times:
                gaps.append(self.began - self.ended)

        def on_train_batch_end(self, batch, logs=None):
            self.ended = time.perf_counter()
            times.append(self.ended - self.began)

    x, y = data()
    epochs = steps * BATCH // len(x)
    # An instrumented model's fit adds its guard after the timer: the
    # search and promotion land between two batches, the retrace in the
    # next batch's time.
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
            # Batches 0..k-1 were skipped; the guard searched and promoted
            # after batch k-1, so batch k retraced.
            search_seconds=gaps[result["lost"] - 1],
            retrace_batch_seconds=times[result["lost"]],
        )
    return result


def table(results):
    lines = [
        "| run | steps | applied | lost | final loss | median batch (s) | search (s) | retrace batch (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        search = r.get("search_seconds")
        retrace = r.get("retrace_batch_seconds")
        lines.append(
            f"| {r['variant']} | {r['steps']} | {r['applied']} | {r['lost']} | "
            f"{r['final_loss']:.4f} | {r['median_batch_seconds']:.4f} | "
            f"{'-' if search is None else f'{search:.2f}'} | "
            f"{'-' if retrace is None else f'{retrace:.2f}'} |"
        )
    return "\n".join(lines)


def main():
    import warnings

    warnings.simplefilter("ignore", UserWarning)
    texts, everything = [], {}
    for scenario in SCENARIOS:
        results = [run(scenario, v) for v in ("float32", "keras", "tf_als")]
        # float32 trained for as many steps as tf_als applied (the batches
        # are the same every epoch, and tf_als lost whole epochs).
        results.append(
            run(scenario, "float32, tf_als's applied steps", results[2]["applied"])
        )
        promoted = results[2]
        texts.append(
            f"## {scenario}\n\n{table(results)}\n\ntf_als promoted "
            f"{promoted['promoted']!r} at step {promoted['promotion_step']} "
            f"after {promoted['lost']} skipped steps (since 0.4 the first "
            "batch is checked before the first step).\n"
        )
        everything[scenario] = results
    text = "\n".join(texts)
    results = everything
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "promotion.md"), "w") as handle:
        handle.write(text)
    with open(os.path.join(RESULTS, "promotion.json"), "w") as handle:
        json.dump(results, handle, indent=2)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
