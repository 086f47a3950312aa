"""Capturing the gradients an inner optimizer receives, and comparing them
with float32 gradients."""

import keras
import numpy as np
import tensorflow as tf

from tests.modes import compiled, loop_step

# float16's unit roundoff.
UNIT_ROUNDOFF = 2.0**-11


class GradientRecorder(keras.optimizers.SGD):
    """SGD with learning rate 0 that keeps, in variables, the last gradient
    it received for each variable (densified) and its dtype. Variables made
    in `build()` so it works eagerly, in `tf.function` and under XLA."""

    def __init__(self, **kwargs):
        kwargs.setdefault("learning_rate", 0.0)
        super().__init__(**kwargs)
        self.received_dtypes = {}

    def build(self, variables):
        super().build(variables)
        self.captured = [
            self.add_variable_from_reference(v, name="captured")
            for v in variables
        ]

    def update_step(self, gradient, variable, learning_rate):
        self.received_dtypes[self._get_variable_index(variable)] = gradient.dtype.name
        dense = tf.convert_to_tensor(gradient)
        self.assign(self.captured[self._get_variable_index(variable)], dense)
        super().update_step(gradient, variable, learning_rate)

    def gradients(self):
        return [keras.ops.convert_to_numpy(v) for v in self.captured]


def applied_gradients(
    model,
    optimizer,
    x,
    y,
    loss,
    mode="function",
    max_steps=40,
    training=True,
    applied=1,
):
    """Steps `model` on one batch until the inner `GradientRecorder` has
    applied `applied` steps (non-finite steps are skipped by the loss scale
    optimizer and retried at half the scale), with learning rate 0, so the
    weights and the true gradient never change.

    One by default: an `AdaptiveLossScaleOptimizer`'s points choose their
    scales from the gradients they scale, so its first applied step already
    runs on them (and Keras's `LossScaleOptimizer` receives the same
    gradient on every step).

    Returns `(gradients, steps)`: the captured numpy gradients of the last
    applied step in `model.trainable_variables` order and how many steps it
    took.
    """
    variables = model.trainable_variables
    optimizer.build(variables)

    def step():
        loop_step(model, optimizer, loss, x, y, training)

    step = compiled(step, mode)
    for steps in range(1, max_steps + 1):
        step()
        if int(keras.ops.convert_to_numpy(optimizer.iterations)) == applied:
            return optimizer.inner_optimizer.gradients(), steps
    raise AssertionError(f"not {applied} finite steps in {max_steps} steps")


def float32_gradients(model, x, y, loss, training=True):
    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=training))
    grads = tape.gradient(value, model.trainable_variables)
    return [keras.ops.convert_to_numpy(tf.convert_to_tensor(g)) for g in grads]


def compare(gradient, reference):
    """Norm ratio, cosine similarity and relative error of one gradient
    against its float32 reference (float64 arithmetic)."""
    g = np.asarray(gradient, np.float64).ravel()
    r = np.asarray(reference, np.float64).ravel()
    norm_g, norm_r = np.linalg.norm(g), np.linalg.norm(r)
    cosine = float(g @ r / (norm_g * norm_r)) if norm_g and norm_r else float("nan")
    return {
        "norm_ratio": float(norm_g / norm_r) if norm_r else float("nan"),
        "cosine": cosine,
        "relative_error": float(np.linalg.norm(g - r) / norm_r) if norm_r else float("nan"),
    }


def faithful(result):
    """Norm ratio in [0.9, 1.1] and cosine >= 0.99."""
    return 0.9 <= result["norm_ratio"] <= 1.1 and result["cosine"] >= 0.99


def oracle_failures(variables, als_grads, keras_grads, expected, same_order_grads):
    """The per-variable criteria of the gradient oracle (tests/test_oracle.py
    explains them), as failure messages: norm ratio in [0.9, 1.1] and
    cosine >= 0.99 wherever Keras's LossScaleOptimizer achieves both on the
    plain model (and there Keras on the instrumented graph must achieve
    them too); relative error at most 1.25 x "Keras's" + 2**-11, where
    "Keras's" is the larger of Keras's on the plain model (`keras_grads`)
    and on an instrumented copy it cannot link to, whose per-layer scales
    all stay 1 (`same_order_grads`); numerically zero float32 gradients
    (below 1e-5 of the largest norm) judged by their absolute error, on the
    scale of the largest."""
    largest = max(np.linalg.norm(g) for g in expected)
    failures = []
    for variable, als, kept, same, truth in zip(
        variables, als_grads, keras_grads, same_order_grads, expected
    ):
        if np.linalg.norm(truth) < 1e-5 * largest:
            error = np.linalg.norm(als - truth)
            keras_error = max(
                np.linalg.norm(kept - truth), np.linalg.norm(same - truth)
            )
            if error > 1.25 * keras_error + UNIT_ROUNDOFF * largest:
                failures.append(f"{variable.path}: abs error {error:.2e}")
            continue
        ours = compare(als, truth)
        theirs = compare(kept, truth)
        reordered = compare(same, truth)
        if faithful(theirs):
            if not faithful(ours):
                failures.append(f"{variable.path}: {ours} (keras: {theirs})")
            if not faithful(reordered):
                failures.append(
                    f"{variable.path}: keras on the instrumented graph "
                    f"{reordered} (keras: {theirs})"
                )
        keras_error = max(theirs["relative_error"], reordered["relative_error"])
        bound = 1.25 * keras_error + UNIT_ROUNDOFF
        if ours["relative_error"] > bound:
            failures.append(
                f"{variable.path}: relative error {ours['relative_error']:.3e}"
                f" > {bound:.3e} (keras {theirs['relative_error']:.3e}, on the"
                f" instrumented graph {reordered['relative_error']:.3e})"
            )
    return failures
