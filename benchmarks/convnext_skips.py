"""keras.applications ConvNeXtTiny (random weights, 32x32, Adam 1e-3,
batch 8), 30 steps of `fit` on the same batches: skipped steps, final
global scale and loss for Keras's LossScaleOptimizer and for tf_als; with
tf_als 0.3 or later also each point's largest step-to-step growth of the
amax of its incoming gradient (what a scale chosen from the previous
step's amax would have to absorb within its overflow margin).

    python benchmarks/convnext_skips.py            # about 5 minutes on 2 cores
    PYTHONPATH=<an older checkout> python benchmarks/convnext_skips.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_als  # noqa: E402

STEPS, BATCH = 30, 8


def build():
    keras.utils.set_random_seed(0)
    return keras.applications.ConvNeXtTiny(
        weights=None, input_shape=(32, 32, 3), classes=10,
        classifier_activation=None,
    )


def run(which, x, y):
    """(skipped steps, final global scale, final loss, per-step raw amax
    of every point or None)."""
    model, inner = build(), keras.optimizers.Adam(1e-3)
    telemetry = "telemetry_interval" in tf_als.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD()
    ).get_config()
    if which == "keras":
        optimizer = keras.optimizers.LossScaleOptimizer(inner)
    else:
        model = tf_als.instrument(model)
        knobs = dict(telemetry_interval=1) if telemetry else {}
        optimizer = tf_als.AdaptiveLossScaleOptimizer(
            inner, max_consecutive_skips=None, **knobs
        )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    raw = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            # amax / T_out: the incoming gradient without the lift the
            # points downstream gave it (still times the global scale).
            rows = model.scaling_state.read()
            raw.append([v["amax"] * v["scale"] / v["cumulative_scale"] for v, _ in rows])

    callbacks = [Record()] if which == "tf_als" and telemetry else []
    history = model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks
    )
    skipped = STEPS - int(keras.ops.convert_to_numpy(inner.iterations))
    scale = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
    names = getattr(model, "scaling_state", None)
    return skipped, scale, history.history["loss"][-1], (raw or None), names


def main():
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(BATCH * STEPS,))
    for which in ("keras", "tf_als"):
        skipped, scale, loss, raw, state = run(which, x, y)
        print(
            f"{which}: skipped {skipped} of {STEPS}, final S 2**{np.log2(scale):g}, "
            f"final loss {loss:.3f}",
            flush=True,
        )
        if raw is None:
            continue
        amax = np.array(raw)  # [steps, points]
        growth = amax[1:] / np.maximum(amax[:-1], 1e-30)
        growth = np.where(np.isfinite(growth) & (amax[:-1] > 0), growth, 0.0)
        worst = growth.max(axis=0)
        order = np.argsort(-worst)[:3]
        print(
            "largest step-to-step growth of a point's incoming amax:",
            ", ".join(f"{state.point_names[i]} {worst[i]:.3g}" for i in order),
        )
        print(
            f"points whose amax grew more than 2**12 (the overflow margin) in "
            f"one step: {int((worst > 2**12).sum())} of {len(worst)}"
        )


if __name__ == "__main__":
    main()
