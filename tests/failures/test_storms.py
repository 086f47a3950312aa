"""Non-finite steps and storms of them.

One bad batch (NaN or inf inputs, NaN labels, a loss that overflows, one
layer whose backward pass overflows) must be skipped with every weight,
optimizer slot and per-layer scale bitwise unchanged, halve the global scale,
and leave training able to go on. `max_consecutive_skips` bad steps in a row
must stop training with a `NonFiniteStormError` that names the layer whose
weight gradient was first non-finite, in `fit` (XLA on and off), eager and
compiled custom loops, and for plain models with the guard callback.

The model: first -> boom -> second -> head (float32 output), MSE on one-hot
targets. `boom` multiplies by a trainable scalar; when armed, its backward
pass turns the gradient it passes on into inf (its own weight gradient stays
finite), a layer-local overflow that no loss scale cures, in float16 and
float32 alike: promoting `boom` cannot help, so `promote_on_storm` (on by
default) must leave it as it is and the storm error must still say what
happened.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tf_als._src.failures import storm
from tf_als._src.scaling import rule
from tests.modes import JIT_COMPILE, loop_step

BATCH = 16


class Boom(keras.layers.Layer):
    """y = x * w; armed, its input gradient is inf."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(), initializer="ones", name="w")
        self.armed = self.add_weight(
            shape=(), initializer="zeros", trainable=False, name="armed", dtype="float32"
        )

    def call(self, x):
        @tf.custom_gradient
        def scale(x, w, armed):
            def grad(dy):
                blow = tf.where(armed > 0, tf.constant(np.inf, dy.dtype), tf.ones([], dy.dtype))
                dw = tf.reduce_sum(tf.cast(dy, tf.float32) * tf.cast(x, tf.float32))
                return dy * tf.cast(w, dy.dtype) * blow, dw, None

            return x * tf.cast(w, x.dtype), grad

        return scale(x, tf.convert_to_tensor(self.w), tf.convert_to_tensor(self.armed))


def build(instrumented=True, **optimizer_kwargs):
    keras.mixed_precision.set_global_policy("mixed_float16")
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, activation="relu", name="first")(inputs)
    x = Boom(name="boom")(x)
    x = keras.layers.Dense(16, activation="relu", name="second")(x)
    outputs = keras.layers.Dense(3, dtype="float32", name="head")(x)
    plain = keras.Model(inputs, outputs)
    model = tf_als.instrument(plain) if instrumented else plain
    optimizer = tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-2), **optimizer_kwargs)
    return model, plain, optimizer


def batch(seed=0, size=BATCH):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(size, 8)).astype("float32")
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, size)]
    return x, y


def arm(plain, on=True):
    plain.get_layer("boom").armed.assign(1.0 if on else 0.0)


def poison(cause, x, y, plain):
    """The bad batch for `cause`, and the layer the storm error must name
    (None: the loss itself is not finite, and the error must say that)."""
    x, y = x.copy(), y.copy()
    if cause == "nan_input":
        x[3, 2] = np.nan
        return x, y, None
    if cause == "inf_input":
        x[5, 0] = np.inf
        return x, y, None
    if cause == "nan_label":
        y[2, 1] = np.nan
        return x, y, None
    if cause == "overflowing_loss":
        # (p - 1e20)**2 overflows float32.
        y[0, 0] = 1e20
        return x, y, None
    assert cause == "one_layer"
    arm(plain)
    return x, y, "first"


def snapshot(model, plain, optimizer):
    """Everything a skipped step must leave alone: weights (BatchNorm-free
    model: all of them trainable or `armed`), the inner optimizer's
    variables (iterations and Adam slots) and every per-layer scale."""
    values = [np.array(w) for w in plain.get_weights()]
    values += [np.array(v) for v in optimizer.inner_optimizer.variables]
    values += [np.array(p.scale) for p in model.scaling_points]
    return values


def assert_bitwise_equal(before, after):
    assert len(before) == len(after)
    for b, a in zip(before, after):
        np.testing.assert_array_equal(b, a)
        assert b.tobytes() == a.tobytes()  # NaN-aware and sign-of-zero aware


@pytest.mark.parametrize(
    "cause", ["nan_input", "inf_input", "nan_label", "overflowing_loss", "one_layer"]
)
def test_bad_batch_is_skipped_and_training_recovers(cause):
    model, plain, optimizer = build(telemetry_interval=1)
    model.compile(optimizer, "mse", jit_compile=False)
    x, y = batch()
    for _ in range(3):
        model.train_on_batch(x, y)
    scale = float(optimizer.dynamic_scale)
    bad_x, bad_y, expected = poison(cause, x, y, plain)
    before = snapshot(model, plain, optimizer)

    model.train_on_batch(bad_x, bad_y)

    # Everything bitwise unchanged; telemetry_interval=1 makes the bad step an
    # update step, so the per-layer scales were re-chosen and must be kept.
    assert_bitwise_equal(before, snapshot(model, plain, optimizer))
    arm(plain, False)
    assert float(optimizer.dynamic_scale) == scale / 2
    assert int(optimizer.consecutive_skips) == 1
    message = storm.describe(optimizer, 1)
    if expected is None:
        assert "the loss itself was not finite" in message
    else:
        assert f"was in layer {expected!r}" in message

    losses = [float(model.train_on_batch(x, y)) for _ in range(3)]
    assert all(np.isfinite(losses))
    assert int(optimizer.consecutive_skips) == 0
    assert int(optimizer.iterations) == 6
    changed = [np.array(w) for w in plain.get_weights()]
    assert any(not np.array_equal(a, b) for a, b in zip(before, changed) if a.shape)
    assert all(np.all(np.isfinite(w)) for w in changed)


@pytest.mark.parametrize("jit_compile", JIT_COMPILE)
def test_storm_stops_fit_naming_the_layer(jit_compile):
    model, plain, optimizer = build(max_consecutive_skips=4)
    model.compile(optimizer, "mse", jit_compile=jit_compile)
    x, y = batch(size=4 * BATCH)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    iterations = int(optimizer.iterations)
    arm(plain)
    with pytest.raises(tf_als.NonFiniteStormError) as caught:
        model.fit(x, y, batch_size=BATCH, epochs=5, verbose=0)
    message = str(caught.value)
    # The first non-finite weight gradient is `first`'s, and what it
    # received came from the scaling point `boom`.
    assert "4 consecutive training steps were skipped" in message
    assert "halved at each, is down to 2048," in message
    assert "was in layer 'first'" in message
    assert "received from 'boom'" in message
    assert "max_consecutive_skips" in message
    # Stopped at exactly the limit: four skipped steps, four halvings.
    assert int(optimizer.consecutive_skips) == 4
    assert int(optimizer.iterations) == iterations
    assert float(optimizer.dynamic_scale) == 2.0**15 / 2**4
    # `boom` fails in float32 too: nothing was promoted.
    assert tf_als.promoted(model) == []
    assert plain.get_layer("boom").compute_dtype == "float16"


def test_nan_data_storm_points_at_the_loss():
    model, plain, optimizer = build(max_consecutive_skips=3)
    model.compile(optimizer, "mse")
    x, y = batch(size=3 * BATCH)
    x[:, 0] = np.nan
    with pytest.raises(tf_als.NonFiniteStormError) as caught:
        model.fit(x, y, batch_size=BATCH, verbose=0)
    message = str(caught.value)
    assert "the loss itself was not finite, so no loss scale can help" in message
    assert "tf_als.diagnose(model, x, y)" in message
    # The batches were re-run in float32 before the data were blamed.
    assert "not finite in float32 either" in message
    # Steps counted as fit counts batches: three, none applied.
    assert "stopped at batch 3 (0 steps applied)" in message


def test_a_finite_step_resets_the_count():
    model, plain, optimizer = build(max_consecutive_skips=3)
    model.compile(optimizer, "mse")
    x, y = batch()
    for armed in (1, 1, 0, 1, 1, 0):
        arm(plain, bool(armed))
        model.train_on_batch(x, y)  # never 3 in a row: no error
    assert int(optimizer.consecutive_skips) == 0
    optimizer.check_skips()


def _mean_squared_error(y, prediction):
    return tf.reduce_mean(keras.losses.mean_squared_error(y, prediction))


def _loop_step(model, optimizer, x, y):
    loop_step(model, optimizer, _mean_squared_error, x, y)


def test_eager_custom_loop_stops_by_itself():
    model, plain, optimizer = build(max_consecutive_skips=3)
    x, y = batch()
    _loop_step(model, optimizer, x, y)
    arm(plain)
    _loop_step(model, optimizer, x, y)
    _loop_step(model, optimizer, x, y)
    with pytest.raises(tf_als.NonFiniteStormError, match="was in layer 'first'"):
        _loop_step(model, optimizer, x, y)


def test_compiled_custom_loop_stops_at_check_skips():
    model, plain, optimizer = build(max_consecutive_skips=3)
    step = tf.function(lambda x, y: _loop_step(model, optimizer, x, y))
    x, y = batch()
    step(x, y)
    optimizer.check_skips()
    arm(plain)
    for _ in range(3):
        step(x, y)  # A graph cannot raise a Python error by itself ...
    assert int(optimizer.consecutive_skips) == 3
    with pytest.raises(tf_als.NonFiniteStormError, match="received from 'boom'"):
        optimizer.check_skips()  # ... so the loop asks after each step.


def test_plain_model_with_the_guard_callback():
    model, plain, optimizer = build(instrumented=False, max_consecutive_skips=2)
    model.compile(optimizer, "mse")
    x, y = batch(size=4 * BATCH)
    arm(plain)
    guard = tf_als.callbacks.NonFiniteGuard()
    with pytest.raises(tf_als.NonFiniteStormError) as caught:
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[guard])
    # Without a plan, names come from variable paths; the layer after
    # `first` in training order stands in for the one that fed it.
    assert "was in layer 'first' (variable 'first/bias')" in str(caught.value)
    assert "received from 'boom'" in str(caught.value)


def test_none_never_stops():
    model, plain, optimizer = build(max_consecutive_skips=None)
    model.compile(optimizer, "mse")
    x, y = batch(size=6 * BATCH)
    arm(plain)
    model.fit(x, y, batch_size=BATCH, verbose=0)  # Keras's behaviour: no stop.
    assert int(optimizer.consecutive_skips) == 6
    assert float(optimizer.dynamic_scale) == 2.0**15 / 2**6
    optimizer.check_skips()


def test_the_global_scale_has_a_floor():
    """Keras halves its global scale at every skipped step, for good: from
    2**15, 165 skips in a row take it to exactly 0 (float32's smallest
    subnormal is 2**-149), and the next finite step divides its gradients
    by 0 and applies NaN. With the stop and promotion off, tf_als skips as
    many steps of a NaN batch and stops halving at `rule.MIN_SCALE`;
    the next finite step applies finite gradients."""
    skips = 170
    x, y = batch(size=skips * BATCH)
    x[:, 0] = np.nan
    good_x, good_y = batch(seed=1)

    # The premise: Keras's LossScaleOptimizer on the same model.
    _, keras_plain, _ = build(instrumented=False)
    keras_plain.compile(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2)), "mse"
    )
    keras_plain.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False)
    assert float(keras_plain.optimizer.dynamic_scale) == 0.0
    keras_plain.train_on_batch(good_x, good_y)
    assert not all(np.all(np.isfinite(w)) for w in keras_plain.get_weights())

    model, plain, optimizer = build(max_consecutive_skips=None, promote_on_storm=False)
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False)
    assert int(optimizer.consecutive_skips) == skips
    assert int(optimizer.iterations) == 0
    assert float(optimizer.dynamic_scale) == rule.MIN_SCALE
    before = [np.array(w) for w in plain.get_weights()]
    loss = float(model.train_on_batch(good_x, good_y))
    assert np.isfinite(loss)
    assert int(optimizer.iterations) == 1
    after = [np.array(w) for w in plain.get_weights()]
    assert all(np.all(np.isfinite(w)) for w in after)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))
    assert float(optimizer.dynamic_scale) == rule.MIN_SCALE


def test_fit_adds_one_guard_to_the_callbacks_given(monkeypatch):
    model, plain, optimizer = build()
    model.compile(optimizer, "mse")
    x, y = batch()
    received = []

    def recording_fit(self, *args, **kwargs):
        received.append(list(args[5]) if len(args) > 5 else list(kwargs["callbacks"]))

    monkeypatch.setattr(keras.Model, "fit", recording_fit)
    other = keras.callbacks.History()
    guard = tf_als.callbacks.NonFiniteGuard()
    model.fit(x, y, BATCH, 1, 0, [other, guard])  # callbacks given positionally
    model.fit(x, y, callbacks=[other])
    model.fit(x, y)
    assert received[0] == [other, guard]
    assert received[1][0] is other and len(received[1]) == 2
    assert len(received[2]) == 1
    assert isinstance(received[1][1], tf_als.callbacks.NonFiniteGuard)
    assert isinstance(received[2][0], tf_als.callbacks.NonFiniteGuard)


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "3", float("inf")])
def test_max_consecutive_skips_is_validated(value):
    with pytest.raises(ValueError, match=r"`max_consecutive_skips` must be an integer >= 1 or None; received"):
        tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), max_consecutive_skips=value)


def test_max_consecutive_skips_round_trips_through_config():
    for value in (7, None):
        optimizer = tf_als.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(), max_consecutive_skips=value
        )
        config = optimizer.get_config()
        assert config["max_consecutive_skips"] == value
        restored = tf_als.AdaptiveLossScaleOptimizer.from_config(config)
        assert restored.max_consecutive_skips == value
    assert tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD()).max_consecutive_skips == 32


MIRRORED_STORM = """
import tensorflow as tf
(cpu,) = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import sys
sys.path.insert(0, {tests!r})
import tf_als
from test_storms import BATCH, arm, batch, build
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    model, plain, optimizer = build(max_consecutive_skips=3)
    model.compile(optimizer, "mse")
x, y = batch(size=4 * BATCH)
model.fit(x, y, batch_size=BATCH, verbose=0)
arm(plain)
try:
    model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0)
except tf_als.NonFiniteStormError as error:
    skips, scale = (v.numpy() for v in (optimizer.consecutive_skips, optimizer.dynamic_scale))
    print("STORM", int(skips), float(scale), error)
"""


@pytest.mark.slow  # ~25 s: a subprocess that starts TensorFlow again
def test_storm_stops_fit_under_mirrored_strategy():
    """Two logical CPU devices (in a subprocess: devices must be split before
    TensorFlow starts). Keras's apply is a cross-replica `merge_call` there;
    the record made at the first skip must survive it."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run(
        [sys.executable, "-c", MIRRORED_STORM.format(tests=tests)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("STORM")]
    assert lines, result.stderr[-3000:]
    _, skips, scale, message = lines[0].split(" ", 3)
    assert (int(skips), float(scale)) == (3, 2.0**15 / 2**3)
    assert "was in layer 'first'" in message and "received from 'boom'" in message


def test_a_float16_forward_overflow_is_reported_as_such(mixed):
    from tests.monitoring.test_report import overflowing_forward

    model, x, y = overflowing_forward()
    model = tf_als.instrument(model)
    model.compile(
        tf_als.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(), max_consecutive_skips=2, promote_on_storm=False
        ),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    with pytest.raises(tf_als.NonFiniteStormError) as caught:
        model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    message = str(caught.value)
    assert "the loss itself was not finite, so no loss scale can help" in message
    assert "stopped at batch 2 (0 steps applied)" in message
    # fit handed its inputs to the guard, which re-ran them eagerly.
    assert message.endswith(
        "An eager re-run on the training data found the first layer whose "
        "float16 output is not finite: 'big'. Give layer 'big' "
        "dtype='float32' where it is built (its weights are float32 already; "
        "Keras casts its inputs and outputs)."
    ), message
    # The same from a tf.data pipeline.
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    with pytest.raises(tf_als.NonFiniteStormError, match="not finite: 'big'"):
        model.fit(data, epochs=2, verbose=0)


def test_guard_checks_its_argument():
    with pytest.raises(TypeError, match="`inputs` must be a callable"):
        tf_als.callbacks.NonFiniteGuard(inputs=[1, 2])
