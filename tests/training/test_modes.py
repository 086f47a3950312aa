"""One training run, every execution mode: `fit` with XLA on and off,
`run_eagerly=True`, and a custom loop (eager, `tf.function`, XLA); plus
the mixed precision contract: float32 variables, float16 compute, float32
updates.

The model is the shared-layer MLP from `architectures`, with the loss
multiplied by 2**-12 so that the per-layer scales leave 1 (the global scale
2**15 alone would not need them) and the update rule is exercised.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tests import architectures
from tests.modes import compiled, loop_step

CASE = architectures.CASES[5]  # shared_layer
STEPS = 5
INTERVAL = 2  # updates at steps 0, 2 and 4


class SmallLoss(keras.losses.Loss):
    def call(self, y_true, y_pred):
        cross_entropy = keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=True
        )
        return cross_entropy * 2.0**-12


def _setup():
    _, mixed = CASE.build_pair()
    model = tf_als.instrument(mixed)
    optimizer = tf_als.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.5), telemetry_interval=INTERVAL
    )
    x, y = CASE.data()
    return model, optimizer, x, y


def _train_fit(jit_compile=False, run_eagerly=False):
    model, optimizer, x, y = _setup()
    model.compile(
        optimizer=optimizer,
        loss=SmallLoss(),
        jit_compile=jit_compile,
        run_eagerly=run_eagerly,
    )
    model.fit(x, y, batch_size=len(x), epochs=STEPS, verbose=0, shuffle=False)
    return model, optimizer


def _train_loop(mode):
    model, optimizer, x, y = _setup()
    loss = SmallLoss()

    def step():
        loop_step(model, optimizer, loss, x, y)

    step = compiled(step, mode)
    for _ in range(STEPS):
        step()
    return model, optimizer


RUNS = {
    "fit": lambda: _train_fit(),
    "fit_xla": lambda: _train_fit(jit_compile=True),
    "fit_run_eagerly": lambda: _train_fit(run_eagerly=True),
    "loop_eager": lambda: _train_loop("eager"),
    "loop_tf_function": lambda: _train_loop("tf_function"),
    "loop_xla": lambda: _train_loop("xla"),
}


@pytest.fixture(scope="module")
def reference():
    """The custom eager loop: the mode every other one is compared with."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    model, optimizer = _train_loop("eager")
    state = [p.read() for p in model.scaling_points]
    weights = [np.asarray(v) for v in model.trainable_variables]
    keras.mixed_precision.set_global_policy("float32")
    return state, weights, float(optimizer.dynamic_scale)


@pytest.mark.parametrize("run", list(RUNS))
def test_every_mode_trains_the_same(mixed, reference, run):
    state, weights, dynamic_scale = reference
    model, optimizer = RUNS[run]()
    got = [p.read() for p in model.scaling_points]
    # The rule ran: every point was updated on the last update step, and
    # some per-layer scales left 1.
    assert {s["last_update"] for s in got} == {4}
    assert max(s["scale"] for s in got) > 1.0
    # Same scales in every mode (they are powers of two chosen from
    # exponents; an element or two rounding differently cannot move them).
    assert [s["scale"] for s in got] == [s["scale"] for s in state]
    assert float(optimizer.dynamic_scale) == dynamic_scale
    assert int(optimizer.iterations) == STEPS
    # Weights agree to float16 rounding: XLA fuses float16 ops and may
    # round intermediate values differently; 5 SGD steps of lr 0.5 keep
    # those differences below 1e-3 relative to the weights' scale.
    for expected, variable in zip(weights, model.trainable_variables):
        actual = np.asarray(variable)
        scale = np.abs(expected).max()
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-3 * scale)


def test_variables_are_float32_and_compute_is_float16(mixed):
    model, optimizer, x, y = _setup()
    loss = SmallLoss()
    variables = model.trainable_variables

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            scaled = optimizer.scale_loss(loss(y, model(x, training=True)))
        optimizer.apply(tape.gradient(scaled, variables), variables)

    graph = step.get_concrete_function().graph
    step()
    # tf_als's state adds an int32 counter (steps of all-zero gradients).
    assert {v.dtype for v in model.variables} <= {"float32", "int64", "int32"}
    assert {v.dtype for v in variables} == {"float32"}
    assert {v.dtype for v in optimizer.variables if "sgd" in v.path} <= {
        "float32",
        "int64",
    }
    # Every layer computes its matmuls, forward and backward, in float16,
    # except the float32 head (its forward and two backward matmuls).
    matmuls = [op for op in graph.get_operations() if op.type == "MatMul"]
    dtypes = [op.get_attr("T") for op in matmuls]
    assert dtypes.count(tf.float32) == 3
    assert dtypes.count(tf.float16) == len(dtypes) - 3 > 0


def test_updates_happen_in_float32(mixed):
    """A step whose updates are far below float16's resolution still moves
    the float32 weights: the inner optimizer applies float32 gradients to
    float32 variables."""
    model, _, x, y = _setup()
    optimizer = tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-6))
    variables = model.trainable_variables
    before = [np.asarray(v) for v in variables]
    with tf.GradientTape() as tape:
        value = optimizer.scale_loss(
            keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
                y, model(x, training=True)
            )
        )
    optimizer.apply(tape.gradient(value, variables), variables)
    moved = 0
    for old, variable in zip(before, variables):
        new = np.asarray(variable)
        delta = np.abs(new - old)
        # Half a float16 step at each weight: an update this small rounds
        # away in float16.
        half_f16_step = np.spacing(np.abs(old).astype(np.float16)).astype(
            np.float32
        ) / 2
        moved += int(np.sum((delta > 0) & (delta < half_f16_step)))
    assert moved > 100
