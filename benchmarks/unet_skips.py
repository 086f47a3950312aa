"""Skipped steps of a U-Net for segmentation: float32, Keras's
`LossScaleOptimizer` and tf_als, from the same weights on the same batches.

The case of issue 39: a U-Net's weight gradients sum the received gradient
over batch x positions (a bias gradient 131,072 terms at 128 px, batch 8),
so they can overflow float16 where the gradient a scaling point receives
does not. The model is `overhead.unet` (4 levels of two 3x3 convolutions,
skip connections by concatenation, a float32 sigmoid output) with 16
filters at the first level; the data are Gaussian images whose target
mask is their smoothed channel sum's sign; `binary_crossentropy`, Adam
1e-3, one epoch. Each row prints the skipped steps (those the inner
optimizer did not apply), the final global scale and the final loss.

    python benchmarks/unet_skips.py                      # 128 px, 60 steps, XLA
    python benchmarks/unet_skips.py --size 256 --steps 30 --xla off
"""

import argparse
import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import overhead  # noqa: E402
import tf_als  # noqa: E402

RUNS = ("float32", "keras", "tf_als")


def data(size, steps, batch):
    """(x, y): `steps * batch` Gaussian images and their masks."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, size, size, 3)).astype("float32")
    box = np.ones(9) / 9
    smooth = x.sum(-1)
    for axis in (1, 2):
        smooth = np.apply_along_axis(lambda r: np.convolve(r, box, "same"), axis, smooth)
    return x, (smooth > 0).astype("float32")[..., None]


def build(size, policy, width):
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        return overhead.unet(keras, size=size, levels=4, width=width)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


def run(name, weights, x, y, args):
    """(skipped steps, final global scale or None, final loss, seconds)."""
    model = build(args.size, "float32" if name == "float32" else "mixed_float16", args.width)
    model.set_weights(weights)
    inner = keras.optimizers.Adam(1e-3)
    optimizer = inner
    if name == "keras":
        optimizer = keras.optimizers.LossScaleOptimizer(inner)
    elif name == "tf_als":
        model = tf_als.instrument(model)
        optimizer = tf_als.AdaptiveLossScaleOptimizer(inner)
    model.compile(optimizer=optimizer, loss="binary_crossentropy", jit_compile=args.xla == "on")
    keras.utils.set_random_seed(1)
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)
    seconds = time.perf_counter() - start
    skipped = args.steps - int(inner.iterations.numpy())
    scale = None if optimizer is inner else float(optimizer.dynamic_scale.numpy())
    return skipped, scale, history.history["loss"][-1], seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--xla", choices=("on", "off"), default="on")
    parser.add_argument("--runs", default=",".join(RUNS))
    args = parser.parse_args(argv)
    runs = args.runs.split(",")
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        parser.error(f"--runs: unknown {unknown}; choose from {list(RUNS)}")
    x, y = data(args.size, args.steps, args.batch)
    weights = build(args.size, "float32", args.width).get_weights()
    print("| input | batch | XLA | run | skipped | final S | final loss | s |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for name in runs:
        skipped, scale, loss, seconds = run(name, weights, x, y, args)
        shown = "-" if scale is None else f"2**{int(math.log2(scale))}" if scale > 0 else "0"
        print(
            f"| {args.size}x{args.size} | {args.batch} | {args.xla} | {name} | "
            f"{skipped} of {args.steps} | {shown} | {loss:.4f} | {seconds:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
