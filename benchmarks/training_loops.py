"""The keras.io training-loop patterns of tests/loops.py, trained longer than
the tests train them, three ways from the same weights on the same batches:
float32, Keras's `LossScaleOptimizer` on the plain float16 models, and
tf_als (every trained model instrumented, one `AdaptiveLossScaleOptimizer`
per optimizer, defaults except `telemetry_interval=10`).

`WGAN-GP conv` rebuilds a reported failure (see `conv_wgan`) and adds a
fourth run, the fix the report's readers would apply by hand.

Reported per pattern: the final losses (the mean over the last epoch),
steps skipped by each optimizer, and for the GANs a sample-quality number,
`tests.loops.sample_error` (mean over features of the gaps between the
generated and the real samples' means and standard deviations; 0 is a
perfect match of both moments), measured on the real data.

    python benchmarks/training_loops.py            # XLA off
    python benchmarks/training_loops.py --xla on
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_als  # noqa: E402
from tests import loops  # noqa: E402

VARIANTS = ("float32", "keras", "tf_als")


def _policy(variant):
    keras.mixed_precision.set_global_policy(
        "float32" if variant == "float32" else "mixed_float16"
    )


def _optimizer(variant, rate):
    inner = keras.optimizers.Adam(rate, beta_1=0.5)
    if variant == "float32":
        return inner
    if variant == "keras":
        return keras.optimizers.LossScaleOptimizer(inner)
    return tf_als.AdaptiveLossScaleOptimizer(inner, telemetry_interval=10)


def _model(variant, build):
    model = build()
    return tf_als.instrument(model) if variant == "tf_als" else model


def _skips(optimizer, calls):
    return calls - int(np.asarray(optimizer.iterations))


def gan(variant, penalty, data, epochs, jit):
    keras.backend.clear_session(free_memory=False)  # (resets the policy)
    _policy(variant)
    generator = _model(variant, lambda: loops.mlp(loops.LATENT, 64, loops.FEATURES, "gen", seed=1))
    critic = _model(variant, lambda: loops.mlp(loops.FEATURES, 64, 1, "critic", "tanh", seed=2))
    model = loops.GAN(generator, critic, penalty=penalty)
    model.compile(d_optimizer=_optimizer(variant, 2e-3), g_optimizer=_optimizer(variant, 2e-3))
    model.jit_compile = jit
    history = model.fit(data, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    steps = epochs * len(data["real"]) // 32
    return {
        "d_loss": history.history["d_loss"][-1],
        "g_loss": history.history["g_loss"][-1],
        "sample_error": loops.sample_error(generator, data),
        "skipped": (_skips(model.d_optimizer, steps), _skips(model.g_optimizer, steps)),
    }


def conv_wgan(variant, data, epochs, jit):
    """WGAN-GP on images with convolutions (tensorflow/tensorflow#48662:
    with a gradient penalty under mixed precision, Keras's loss scale
    "quickly decreases to 1"). The fourth run, `fix`, is Keras's
    LossScaleOptimizer with PyTorch's recipe for penalties under loss
    scaling: the penalty's inner gradient is taken of the scaled score and
    unscaled before use."""
    keras.backend.clear_session(free_memory=False)  # (resets the policy)
    base = "keras" if variant == "fix" else variant
    _policy(base)
    generator = _model(base, lambda: loops.conv_generator(seed=1))
    critic = _model(base, lambda: loops.conv_critic(seed=2))
    model = loops.GAN(generator, critic, penalty=10.0, scale_penalty=variant == "fix")
    model.compile(d_optimizer=_optimizer(base, 2e-4), g_optimizer=_optimizer(base, 2e-4))
    model.jit_compile = jit
    history = model.fit(data, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    steps = epochs * len(data["real"]) // 32
    scale = getattr(model.d_optimizer, "dynamic_scale", None)
    return {
        "d_loss": history.history["d_loss"][-1],
        "g_loss": history.history["g_loss"][-1],
        "sample_error": loops.sample_error(generator, data),
        "skipped": (_skips(model.d_optimizer, steps), _skips(model.g_optimizer, steps)),
        "scale": None if scale is None else float(np.asarray(scale)),
    }


def vae(variant, data, epochs, jit):
    keras.backend.clear_session(free_memory=False)  # (resets the policy)
    _policy(variant)
    encoder = _model(variant, lambda: loops.mlp(loops.FEATURES, 64, 2 * loops.LATENT, "enc", seed=3))
    decoder = _model(variant, lambda: loops.mlp(loops.LATENT, 64, loops.FEATURES, "dec", seed=4))
    model = loops.VAE(encoder, decoder)
    model.compile(optimizer=_optimizer(variant, 1e-3), jit_compile=jit)
    history = model.fit(data, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    steps = epochs * len(data["real"]) // 32
    return {"loss": history.history["loss"][-1], "skipped": (_skips(model.optimizer, steps),)}


def distiller(variant, data, epochs, jit):
    keras.backend.clear_session(free_memory=False)  # (resets the policy)
    _policy(variant)
    teacher = loops.mlp(loops.FEATURES, 64, 2, "teacher", seed=5)
    student = _model(variant, lambda: loops.mlp(loops.FEATURES, 16, 2, "student", seed=6))
    model = loops.Distiller(student, teacher)
    model.compile(optimizer=_optimizer(variant, 1e-3), jit_compile=jit)
    history = model.fit(data, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    steps = epochs * len(data["real"]) // 32
    return {"loss": history.history["loss"][-1], "skipped": (_skips(model.optimizer, steps),)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--xla", choices=("off", "on"), default="off")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument(
        "--patterns", default="DCGAN,WGAN-GP,VAE,distillation,WGAN-GP conv",
        help="comma-separated, from the table's pattern names",
    )
    args = parser.parse_args()
    jit = args.xla == "on"
    data = loops.data(args.samples)
    data["label"] = (data["real"][:, 0] > data["real"][:, 0].mean()).astype("int32")
    patterns = {
        "DCGAN": lambda v: gan(v, 0.0, data, args.epochs, jit),
        "WGAN-GP": lambda v: gan(v, 10.0, data, args.epochs, jit),
        "VAE": lambda v: vae(v, data, args.epochs, jit),
        "distillation": lambda v: distiller(v, data, args.epochs, jit),
    }
    pictures = loops.images(args.samples)
    patterns["WGAN-GP conv"] = lambda v: conv_wgan(v, pictures, args.epochs, jit)
    chosen = args.patterns.split(",")
    steps = args.epochs * args.samples // 32
    print(f"XLA {args.xla}, {steps} steps of batch 32 per run\n")
    print("| pattern | run | final losses | sample error | skipped steps | final global scale |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, train in patterns.items():
        if name not in chosen:
            continue
        for variant in VARIANTS + (("fix",) if name == "WGAN-GP conv" else ()):
            result = train(variant)
            losses = ", ".join(
                f"{k} {result[k]:.4f}" for k in ("d_loss", "g_loss", "loss") if k in result
            )
            quality = f"{result['sample_error']:.3f}" if "sample_error" in result else "-"
            skipped = "/".join(str(s) for s in result["skipped"])
            scale = result.get("scale")
            scale = "-" if scale is None else f"2**{np.log2(scale):.0f}"
            print(f"| {name} | {variant} | {losses} | {quality} | {skipped} | {scale} |", flush=True)


if __name__ == "__main__":
    main()
