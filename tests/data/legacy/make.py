"""Writes the `.keras` file of an older tf_als that test_legacy_files loads.

Run with the older version importable, e.g. from a checkout of its tag:

    PYTHONPATH=<checkout of 0.4> python tests/data/legacy/make.py 0.4

It trains a small functional model (Dense, BatchNormalization, Dense in
float32; the first Dense promoted to float32) two epochs under
`mixed_float16` and writes `tf_als-<version>.keras` and, beside it, what
the loaded model must reproduce (`tf_als-<version>.npz`: its predictions
on fixed inputs, its promotions, its scales and its optimizer's step count
and global scale).
"""

import os
import sys

import keras
import numpy as np

import tf_als

try:
    from tf_als import promote  # 0.2-0.4
except ImportError:
    from tf_als._src.failures import promote  # 0.5

HERE = os.path.dirname(os.path.abspath(__file__))


def main(version):
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.integers(0, 3, size=(64,))
    # Nothing the file holds is at its initial value: an inf in the second
    # batch halves the global scale, and a loss weighted by 2**-12 through
    # sigmoids takes the per-point scales off 1.
    x_train = x.copy()
    x_train[16, 0] = np.inf
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="sigmoid", name="d1")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    outputs = keras.layers.Dense(3, dtype="float32", name="d2")(h)
    model = tf_als.instrument(keras.Model(inputs, outputs))
    # A promotion of d1 to float32, as one found on a first batch is
    # recorded (every version saves its promotions in the same form).
    promotion = {"layer": "d1", "reason": "float16 forward output not finite", "step": 0}
    promote.restore(model, [promotion])
    model.compile(
        optimizer=tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-3)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        loss_weights=2.0**-12,
    )
    model.fit(x_train, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    path = os.path.join(HERE, f"tf_als-{version}")
    model.save(path + ".keras")
    np.savez(
        path + ".npz",
        x=x,
        y=y,
        predictions=model.predict(x[:16], verbose=0),
        promoted=[p.layer for p in model.promotions],
        scales=keras.ops.convert_to_numpy(model.scaling_state.scales),
        iterations=int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        global_scale=float(keras.ops.convert_to_numpy(model.optimizer.dynamic_scale)),
    )


if __name__ == "__main__":
    main(sys.argv[1])
