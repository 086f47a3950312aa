"""Scale semantics of the backward pass (docs/design.md), checked exactly.

The model below has every structure the bookkeeping handles: a tensor
forking into two scaling points (`stem` -> `left`, `right`), a weightless
join (`Add`), a layer called twice (`shared`), a tensor consumed by a
scaling point and by a second output head (`u` -> `shared` call 1, `aux`),
and two outputs.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tests import gradients
from tests.modes import MODES, compiled

layers = keras.layers



def _bookkeeping_model():
    inputs = keras.Input((16,))
    h = layers.Dense(16, activation="tanh", name="stem")(inputs)
    a = layers.Dense(16, activation="tanh", name="left")(h)
    b = layers.Dense(16, activation="tanh", name="right")(h)
    s = layers.Add()([a, b])
    shared = layers.Dense(16, activation="tanh", name="shared")
    u = shared(s)
    v = shared(u)
    head = layers.Dense(4, name="head")(v)
    aux = layers.Dense(2, name="aux")(u)
    return keras.Model(inputs, [head, aux])


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16)).astype("float32")
    y = (
        rng.normal(size=(32, 4)).astype("float32"),
        rng.normal(size=(32, 2)).astype("float32"),
    )
    return x, y


def _loss(y, outputs):
    head, aux = outputs
    return keras.ops.mean(keras.ops.square(head - y[0])) + keras.ops.mean(
        keras.ops.square(aux - y[1])
    )


def _run(mode, function):
    return compiled(function, mode)()


# Distinct scales per point (powers of two), small enough that with the
# loss scaled by 2**6 no value in either model over- or underflows.
FIXED_SCALES = {
    "stem": 2.0,
    "left": 4.0,
    "right": 8.0,
    "shared/call_0": 2.0,
    "shared/call_1": 4.0,
    "head": 8.0,
    "aux": 2.0,
}


@pytest.mark.parametrize("mode", MODES)
def test_rescaling_is_exact(mixed, mode):
    """Scaling by powers of two, fork alignment and per-call unscaling
    change no bit of any weight gradient when nothing under- or overflows:
    the instrumented model's gradients equal the plain model's bitwise."""
    model = _bookkeeping_model()
    instrumented = tf_als.instrument(model)
    for point in instrumented.scaling_points:
        point.scale.assign(FIXED_SCALES[point.point_name])
    x, y = _data()

    def gradient_of(m):
        def step():
            with tf.GradientTape() as tape:
                value = _loss(y, m(x, training=True)) * 64.0
            return tape.gradient(value, m.trainable_variables)

        return [np.asarray(g) for g in _run(mode, step)]

    plain = gradient_of(model)
    scaled = gradient_of(instrumented)
    # No optimizer was linked, so the scales were used as they are.
    assert tf_als.scales(instrumented) == FIXED_SCALES
    for variable, p, s in zip(model.trainable_variables, plain, scaled):
        assert s.dtype == np.float32
        np.testing.assert_array_equal(s, p, err_msg=variable.path)


def test_a_wrong_unscale_would_be_caught(mixed):
    """Guards the test above: had one call of the shared layer been
    unscaled by the other call's scale, its gradient would differ."""
    model = _bookkeeping_model()
    instrumented = tf_als.instrument(model)
    for point in instrumented.scaling_points:
        point.scale.assign(FIXED_SCALES[point.point_name])
    x, y = _data()
    with tf.GradientTape() as tape:
        value = _loss(y, instrumented(x, training=True)) * 64.0
    variables = instrumented.trainable_variables
    grads = dict(zip([v.path for v in variables], tape.gradient(value, variables)))
    with tf.GradientTape() as tape:
        value = _loss(y, model(x, training=True)) * 64.0
    plain = dict(zip([v.path for v in variables], tape.gradient(value, variables)))
    assert not np.array_equal(
        np.asarray(grads["shared/kernel"]) * 2.0, np.asarray(plain["shared/kernel"])
    )


def test_cumulative_scales_follow_the_rule(mixed):
    """After an update, each point's recorded T_in equals s_n * T_out(n),
    with T(t) the minimum over t's consumers and T = 1 at the outputs."""
    model = tf_als.instrument(_bookkeeping_model())
    optimizer = tf_als.AdaptiveLossScaleOptimizer(
        gradients.GradientRecorder(), initial_scale=1.0, telemetry_interval=1
    )
    x, y = _data()
    gradients.applied_gradients(model, optimizer, x, y, _loss)
    state = {p.point_name: p.read() for p in model.scaling_points}
    s = {name: r["scale"] for name, r in state.items()}
    t_in = {}
    t_in["head"] = s["head"]
    t_in["aux"] = s["aux"]
    t_in["shared/call_1"] = s["shared/call_1"] * t_in["head"]
    t_u = min(t_in["shared/call_1"], t_in["aux"])
    t_in["shared/call_0"] = s["shared/call_0"] * t_u
    t_in["left"] = s["left"] * t_in["shared/call_0"]  # through the Add
    t_in["right"] = s["right"] * t_in["shared/call_0"]
    t_in["stem"] = s["stem"] * min(t_in["left"], t_in["right"])
    assert {n: r["cumulative_scale"] for n, r in state.items()} == t_in
    # With the global scale at 1 the gradients are small, so the points
    # did lift them: the rule is exercised with scales other than 1.
    assert len(set(s.values())) > 1 and max(s.values()) > 1.0


def test_each_point_sees_the_new_scales_downstream(mixed):
    """A point measures the gradient as it arrives, after the points
    closer to the loss applied their new scales in the same step: its
    recorded amax, divided by S * T_out, is the true amax of dL/d(output)
    (float32 reference, float16 rounding tolerance 2**-10 relative)."""
    inputs = keras.Input((16,))
    hidden = layers.Dense(32, activation="tanh", name="hidden")(inputs)
    outputs = layers.Dense(4, name="top", dtype="float32")(hidden)
    keras.mixed_precision.set_global_policy("float32")
    reference = keras.Model(inputs, outputs)
    keras.mixed_precision.set_global_policy("mixed_float16")
    inputs = keras.Input((16,))
    hidden = layers.Dense(32, activation="tanh", name="hidden")(inputs)
    outputs = layers.Dense(4, name="top", dtype="float32")(hidden)
    model = keras.Model(inputs, outputs)
    model.set_weights(reference.get_weights())
    x, y = _data()
    y = y[0]

    def loss(y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_pred - y_true)) * 2.0**-10

    # True gradient at the hidden layer's output, in float32.
    probe = keras.Model(
        reference.input, [reference.get_layer("hidden").output, reference.output]
    )
    with tf.GradientTape() as tape:
        h, out = probe(x)
        value = loss(y, out)
    true_amax = float(tf.reduce_max(tf.abs(tape.gradient(value, h))))

    instrumented = tf_als.instrument(model)
    optimizer = tf_als.AdaptiveLossScaleOptimizer(
        gradients.GradientRecorder(), initial_scale=1.0, telemetry_interval=1
    )
    gradients.applied_gradients(instrumented, optimizer, x, y, loss)
    state = {p.point_name: p.read() for p in instrumented.scaling_points}
    assert state["top"]["scale"] > 1.0  # the top point did lift
    measured = state["hidden"]["amax"] / state["top"]["cumulative_scale"]
    assert measured == pytest.approx(true_amax, rel=2.0**-10)


def test_telemetry_is_recorded_every_interval_and_scales_every_step(mixed):
    """telemetry_interval=3: the records (statistics, T_in, step) change on
    steps 0, 3, 6 only; the scales are the latest step's on every step."""
    model = tf_als.instrument(_bookkeeping_model())
    optimizer = tf_als.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.05), initial_scale=1.0, telemetry_interval=3
    )
    x, y = _data()
    variables = model.trainable_variables
    chosen = []

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            value = optimizer.scale_loss(_loss(y, model(x, training=True)))
        optimizer.apply(tape.gradient(value, variables), variables)
        # What the points chose in this very pass.
        records = model.pass_record.latest()
        return [records[i].scale for i in sorted(records)]

    history = []
    for _ in range(8):
        chosen.append([float(s) for s in step()])
        history.append([p.read() for p in model.scaling_points])
    for i, states in enumerate(history):
        expected_last = (i // 3) * 3
        assert {s["last_update"] for s in states} == {expected_last}, i
        assert [s["scale"] for s in states] == chosen[i], i
        if i % 3:
            without_scale = [dict(s, scale=None) for s in states]
            before = [dict(s, scale=None) for s in history[i - 1]]
            assert without_scale == before, i


def test_without_a_linked_optimizer_scales_stay_fixed(mixed):
    model = tf_als.instrument(_bookkeeping_model())
    x, y = _data()
    before = [p.read() for p in model.scaling_points]
    with tf.GradientTape() as tape:
        value = _loss(y, model(x, training=True))
    tape.gradient(value, model.trainable_variables)
    assert [p.read() for p in model.scaling_points] == before


def test_a_non_finite_step_keeps_the_scales(mixed):
    """A step whose gradient is not finite is skipped by the loss scale
    optimizer; the scales the points chose from it are not kept (under the
    paper's rule they would serve until the next update)."""
    model = tf_als.instrument(_bookkeeping_model())
    for point in model.scaling_points:
        point.scale.assign(FIXED_SCALES[point.point_name])
    optimizer = tf_als.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(0.1), telemetry_interval=1
    )
    x, y = _data()
    weights = [np.asarray(v) for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        value = optimizer.scale_loss(_loss(y, model(x, training=True)) * np.inf)
    variables = model.trainable_variables
    optimizer.apply(tape.gradient(value, variables), variables)
    assert tf_als.scales(model) == FIXED_SCALES
    for before, variable in zip(weights, model.trainable_variables):
        np.testing.assert_array_equal(before, np.asarray(variable))
    assert float(optimizer.dynamic_scale) == 2.0**14


class PenalisedDense(keras.layers.Layer):
    """A weight layer that adds a loss from its own call, on its kernel:
    the loss reads the value the call read."""

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], 8), name="kernel")

    def call(self, x):
        self.add_loss(0.01 * keras.ops.sum(keras.ops.square(self.kernel)))
        return keras.ops.matmul(x, self.kernel)


class Block(keras.layers.Layer):
    """A composite: its Dense, BatchNormalization (moving statistics
    assigned in a training call) and a penalised Dense."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(8)
        self.norm = layers.BatchNormalization()
        self.penalised = PenalisedDense()

    def call(self, x, training=None):
        return self.penalised(self.norm(self.dense(x), training=training))


@pytest.mark.parametrize("mode", MODES)
def test_a_points_reads_assignments_and_losses_are_the_plain_models(mixed, mode):
    """A point's weights are read once, outside its custom gradient, and
    mapped into its call: what the call assigns (a batch norm's moving
    statistics) and the losses it adds from inside must come out as the
    plain model's, and the weight gradients, the added loss's included,
    bitwise equal (scales 2**k, nothing under- or overflows)."""
    inputs = keras.Input((16,))
    outputs = layers.Dense(2, name="head")(Block(name="block")(inputs))
    model = keras.Model(inputs, outputs)
    instrumented = tf_als.instrument(model)
    for point in instrumented.scaling_points:
        point.scale.assign(4.0)
    x, _ = _data()
    start = [np.asarray(v) for v in model.non_trainable_variables]

    def step_of(m):
        def step():
            with tf.GradientTape() as tape:
                y = m(x, training=True)
                value = keras.ops.mean(keras.ops.square(y)) + sum(m.losses)
            grads = tape.gradient(value * 64.0, m.trainable_variables)
            return value, grads, list(m.non_trainable_variables)

        value, grads, moving = _run(mode, step)
        moving = [np.array(v) for v in moving]
        for v, s in zip(model.non_trainable_variables, start):
            v.assign(s)  # The next run starts where this one did.
        return value, grads, moving

    plain = step_of(model)
    scaled = step_of(instrumented)
    assert len(instrumented.losses) == len(model.losses) == 1
    np.testing.assert_array_equal(np.asarray(scaled[0]), np.asarray(plain[0]))
    for variable, p, s in zip(model.trainable_variables, plain[1], scaled[1]):
        np.testing.assert_array_equal(np.asarray(s), np.asarray(p), variable.path)
    moving = zip(model.non_trainable_variables, plain[2], scaled[2], start)
    for variable, p, s, s0 in moving:
        assert not np.array_equal(p, s0), variable.path  # The call assigned it.
        np.testing.assert_array_equal(s, p, variable.path)
