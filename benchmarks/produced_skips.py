"""Skipped steps where weight-gradient sums overflow: float32, Keras's
`LossScaleOptimizer` and tf_als, from the same weights on the same batches.

The models of issue 39. A convolution's weight gradients sum the received
gradient over batch x positions (a bias gradient 131,072 terms at 128 px,
batch 8), so they can overflow float16 where the gradient a scaling point
receives does not; a loss summed over pixels or anchors instead of
averaged makes every gradient larger.

- `unet`: `tests/architectures.py`'s `unet` (4 levels of two 3x3 convolutions, skip
  connections by concatenation, a float32 sigmoid output), 16 filters at
  the first level; Gaussian images whose target mask is their smoothed
  channel sum's sign; binary cross-entropy, averaged (`--loss mean`) or
  summed over the pixels of each image (`--loss sum`).
- `detector`: an SSD-style detector: five strided convolution stages,
  multi-scale 3x3 heads on the last three maps (4 anchors a position),
  box offsets regressed with a Huber loss summed over the matched anchors
  and a focal classification loss summed over all anchors, both divided
  by the number of matched anchors, as SSD and RetinaNet normalise them
  (`--loss sum`: not divided).
- `conv3d`: a 3D convolutional segmenter of `--size`^3 volumes (two
  levels of 3x3x3 convolutions, a strided one down, a skip connection, a
  float32 sigmoid), binary cross-entropy as `unet`'s.

Adam 1e-3, one epoch. Each row prints the skipped steps (those the inner
optimizer did not apply), the final global scale and the final loss. To
measure another version of tf_als, pass its checkout as `--tf-als`.

    python benchmarks/produced_skips.py                      # U-Net, 128 px, 60 steps, XLA
    python benchmarks/produced_skips.py --size 256 --steps 30 --xla off
    python benchmarks/produced_skips.py --model detector --size 256 --steps 30
    python benchmarks/produced_skips.py --model conv3d --size 32 --batch 4
    python benchmarks/produced_skips.py --runs tf_als --tf-als ../tf_als-0.5
"""

import argparse
import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402

from tests import architectures  # noqa: E402

RUNS = ("float32", "keras", "tf_als")


MODELS = ("unet", "detector", "conv3d")



def _tf_als():
    """tf_als, imported from `--tf-als` when given (another version's
    checkout: its package, with this checkout's models and tests)."""
    import tf_als

    return tf_als

def loss_of(args):
    if args.model == "detector":
        return architectures.detection_loss(normalise=args.loss == "mean")
    return architectures.pixel_loss(args.loss)


def build(args, policy):
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        if args.model == "detector":
            return architectures.detector(args.size, args.width)
        if args.model == "conv3d":
            return architectures.conv3d(args.size, args.width)
        return architectures.unet(args.size, levels=4, width=args.width)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


def run(name, weights, x, y, args):
    """(skipped steps, final global scale or None, final loss, seconds)."""
    model = build(args, "float32" if name == "float32" else "mixed_float16")
    model.set_weights(weights)
    inner = keras.optimizers.Adam(1e-3)
    optimizer = inner
    if name == "keras":
        optimizer = keras.optimizers.LossScaleOptimizer(inner)
    elif name == "tf_als":
        model = _tf_als().instrument(model)
        optimizer = _tf_als().AdaptiveLossScaleOptimizer(inner)
    model.compile(optimizer=optimizer, loss=loss_of(args), jit_compile=args.xla == "on")
    keras.utils.set_random_seed(1)
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)
    seconds = time.perf_counter() - start
    skipped = args.steps - int(inner.iterations.numpy())
    scale = None if optimizer is inner else float(optimizer.dynamic_scale.numpy())
    return skipped, scale, history.history["loss"][-1], seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tf-als", default=None, help="a checkout of another tf_als version to measure")
    parser.add_argument("--model", choices=MODELS, default="unet")
    parser.add_argument("--loss", choices=("mean", "sum"), default="mean")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--width", type=int, default=None, help="first level's filters (16; conv3d 8)")
    parser.add_argument("--xla", choices=("on", "off"), default="on")
    parser.add_argument("--runs", default=",".join(RUNS))
    args = parser.parse_args(argv)
    if args.tf_als:
        sys.path.insert(0, os.path.abspath(args.tf_als))
    if args.width is None:
        args.width = 8 if args.model == "conv3d" else 16
    runs = args.runs.split(",")
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        parser.error(f"--runs: unknown {unknown}; choose from {list(RUNS)}")
    x, y = architectures.overflow_data(args.model, args.size, args.steps * args.batch)
    weights = build(args, "float32").get_weights()
    tf_als = _tf_als()
    print(f"tf_als {tf_als.__version__} from {os.path.dirname(tf_als.__file__)}")
    print("| model | input | batch | loss | XLA | run | skipped | final S | final loss | s |")
    print("| --- | --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for name in runs:
        skipped, scale, loss, seconds = run(name, weights, x, y, args)
        shown = "-" if scale is None else f"2**{int(math.log2(scale))}" if scale > 0 else "0"
        print(
            f"| {args.model} | {args.size}^{3 if args.model == 'conv3d' else 2} | {args.batch} | "
            f"{args.loss} | {args.xla} | {name} | "
            f"{skipped} of {args.steps} | {shown} | {loss:.4f} | {seconds:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
