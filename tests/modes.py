"""How tests run a function or a training step: eagerly, in a `tf.function`,
or compiled with XLA, and the custom training loop's step."""

import pytest
import tensorflow as tf

MODES = ("eager", "tf_function", "xla")

# `jit_compile` for a `fit` test: without XLA in the default suite, with XLA
# (the same step, compiled; slower to compile) in the slow one. Use with
# `@pytest.mark.parametrize("jit_compile", JIT_COMPILE)`.
JIT_COMPILE = (
    pytest.param(False, id="graph"),
    pytest.param(True, id="xla", marks=pytest.mark.slow),
)


def compiled(function, mode, autograph=True):
    """`function` as it runs in `mode` (one of `MODES`; "function" is
    accepted for "tf_function")."""
    if mode == "eager":
        return function
    if mode in ("tf_function", "function"):
        return tf.function(function, autograph=autograph)
    if mode == "xla":
        return tf.function(function, jit_compile=True, autograph=autograph)
    raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


def loop_step(model, optimizer, loss, x, y, training=True):
    """One step of the custom training loop a user writes: the forward pass
    and the scaled loss under a tape, the gradients, `optimizer.apply`.
    Returns the gradients applied."""
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=training))
        scaled = optimizer.scale_loss(value)
    grads = tape.gradient(scaled, variables)
    optimizer.apply(grads, variables)
    return grads
