"""Self-healing float16 (`promote_on_storm`): a layer whose float16 forward
pass overflows is switched to float32, and the run trains on.

The model: first -> hot -> head (float32 output). `hot` is a Dense with a
softmax and a bias of 1e5 on every unit (a large common offset, which softmax
ignores): its float16 logits overflow to inf and the softmax turns them into
NaN, while float32 holds them and its softmax output, in [0, 1], fits float16
again. No loss scale can cure that; promoting `hot` can.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tf_als import promote
from tests.modes import JIT_COMPILE

layers = keras.layers
pytestmark = pytest.mark.usefixtures("mixed")

STEPS = 60
BATCH = 16
SKIPS = 3


def build(policy=None):
    """The model under `policy` (the global one when None), with fixed
    weights."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    x = layers.Dense(16, name="first", dtype=policy)(inputs)
    x = layers.Dense(16, activation="softmax", name="hot", dtype=policy)(x)
    outputs = layers.Dense(4, dtype="float32", name="head")(x)
    model = keras.Model(inputs, outputs)
    hot = model.get_layer("hot")
    hot.bias.assign(tf.fill(hot.bias.shape, 1e5))
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * 4, 8)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + 2 * (x[:, 1] > 0).astype("int32")


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def optimizer(**kwargs):
    kwargs.setdefault("max_consecutive_skips", SKIPS)
    return tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-2), **kwargs)


def test_the_model_overflows_in_float16_only():
    x, _ = data()
    assert np.all(np.isfinite(build("float32")(x)))
    assert not np.all(np.isfinite(build()(x)))
    assert tf_als.forward.first_non_finite_output(build(), x) == "hot"


@pytest.mark.parametrize("jit_compile", JIT_COMPILE)
def test_fit_promotes_the_layer_and_trains_like_float32(jit_compile):
    """The promoted run loses its first SKIPS steps (skipped), then trains.
    Its loss after the same number of applied steps is within 2% of
    float32's (the issue's bound): float16 rounding in `first` is all that
    differs (measured: 0.799037-0.799048 against 0.799067, from 1.39 at the
    start)."""
    x, y = data()
    model = tf_als.instrument(build())
    model.compile(optimizer(), loss_fn(), jit_compile=jit_compile)
    with pytest.warns(UserWarning, match="promoted layer 'hot' to float32 at step 0"):
        model.fit(x, y, batch_size=BATCH, epochs=STEPS // 4, verbose=0, shuffle=False)
    assert tf_als.promoted(model) == [
        promote.Promotion(layer="hot", reason=promote.FORWARD, step=0)
    ]
    assert model.model.get_layer("hot").compute_dtype == "float32"
    assert model.model.get_layer("first").compute_dtype == "float16"
    applied = int(model.optimizer.iterations.numpy())
    assert applied == STEPS - SKIPS
    # Training goes on at the scale it had before the streak.
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**15

    reference = build("float32")
    reference.compile(keras.optimizers.Adam(1e-2), loss_fn())
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]
    # The same batches in the same order, less the SKIPS skipped ones.
    order = [batches[i % 4] for i in range(SKIPS, STEPS)]
    for xb, yb in order:
        reference.train_on_batch(xb, yb)
    expected = reference.evaluate(x, y, verbose=0)
    got = model.evaluate(x, y, verbose=0)
    assert np.isfinite(got)
    assert abs(got - expected) <= 0.02 * expected, (got, expected)


def test_off_it_stops_as_before():
    x, y = data()
    model = tf_als.instrument(build())
    model.compile(optimizer(promote_on_storm=False), loss_fn())
    with pytest.raises(tf_als.NonFiniteStormError, match="not finite: 'hot'"):
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    assert tf_als.promoted(model) == []


def custom_loop(model, opt, loss, xb, yb, steps, check, compiled=True):
    """Trains `steps` steps on one batch in a custom loop, calling
    `check(opt, xb, yb)` (a `check_skips` call) after each and making the
    compiled step again when it promoted; returns the promotions."""

    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(loss(yb, model(xb, training=True)))
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)

    make = tf.function if compiled else (lambda f: f)
    step, promoted = make(train_step), []
    for _ in range(steps):
        step(xb, yb)
        made = check(opt, xb, yb)
        if made:
            promoted += made
            step = make(train_step)
    return promoted


def test_a_compiled_custom_loop_promotes_through_check_skips():
    x, y = data()
    model = tf_als.instrument(build())
    opt = optimizer()
    promoted = custom_loop(
        model, opt, loss_fn(), x[:BATCH], y[:BATCH], 8,
        lambda opt, xb, yb: opt.check_skips(batches=lambda: [xb]),
    )
    assert [p.layer for p in promoted] == ["hot"]
    assert int(opt.iterations.numpy()) == 8 - SKIPS


def test_promotions_survive_save_and_load(tmp_path):
    x, y = data()
    model = tf_als.instrument(build())
    model.compile(optimizer(), loss_fn())
    with pytest.warns(UserWarning, match="promoted"):
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert tf_als.promoted(loaded) == tf_als.promoted(model)
    assert loaded.model.get_layer("hot").compute_dtype == "float32"
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    # Training resumes without skipping.
    before = int(loaded.optimizer.iterations.numpy())
    loaded.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == before + 4


def test_past_the_cap_it_stops_listing_what_it_promoted():
    """Two overflowing layers in a model of three layers with weights: the
    cap (10%, at least one) allows one."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    x = layers.Dense(16, activation="softmax", name="hot")(inputs)
    x = layers.Dense(16, activation="softmax", name="hotter")(x)
    outputs = layers.Dense(4, dtype="float32", name="head")(x)
    plain = keras.Model(inputs, outputs)
    for name in ("hot", "hotter"):
        layer = plain.get_layer(name)
        layer.kernel.assign(layer.kernel * 1e6)
    x, y = data()
    model = tf_als.instrument(plain)
    model.compile(optimizer(), loss_fn())
    with pytest.raises(tf_als.NonFiniteStormError) as caught:
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    message = str(caught.value)
    assert (
        f"layer 'hotter' would also need float32 ({promote.FORWARD}), past the cap of 1"
        in message
    )
    assert "promoted so far: 'hot'" in message
    assert [p.layer for p in tf_als.promoted(model)] == ["hot"]


def test_a_layer_that_fails_in_float32_too_is_not_promoted():
    """`boom` (tests/test_storms.py) emits inf in its backward pass in any
    dtype: it is promoted, found failing the same way in float32, put back,
    and the storm error says why."""
    from tests import test_storms

    model, plain, opt = test_storms.build(max_consecutive_skips=2)
    model.compile(opt, "mse")
    x, y = test_storms.batch(size=4 * test_storms.BATCH)
    test_storms.arm(plain)
    with pytest.raises(
        tf_als.NonFiniteStormError, match="layer 'boom' is not finite in float32 either"
    ):
        model.fit(x, y, batch_size=test_storms.BATCH, epochs=2, verbose=0)
    assert tf_als.promoted(model) == []
    assert plain.get_layer("boom").compute_dtype == "float16"


def test_a_healthy_run_is_bitwise_unchanged():
    x, y = data()
    results = []
    for flag in (True, False):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((8,))
        h = layers.Dense(16, activation="relu")(inputs)
        outputs = layers.Dense(4, dtype="float32")(h)
        model = tf_als.instrument(keras.Model(inputs, outputs))
        model.compile(optimizer(promote_on_storm=flag), loss_fn())
        model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False)
        results.append([v.numpy() for v in model.variables + model.optimizer.variables])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_promote_on_storm_is_validated_and_round_trips():
    with pytest.raises(ValueError, match="`promote_on_storm` must be True or False"):
        optimizer(promote_on_storm="yes")
    config = optimizer(promote_on_storm=False).get_config()
    assert config["promote_on_storm"] is False
    assert not tf_als.AdaptiveLossScaleOptimizer.from_config(config).promote_on_storm


def test_scale_history_records_the_promotion(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    x, y = data()
    model = tf_als.instrument(build())
    model.compile(optimizer(), loss_fn())
    log_dir = str(tmp_path / "logs")
    history = tf_als.callbacks.ScaleHistory(log_dir=log_dir)
    with pytest.warns(UserWarning, match="promoted"):
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[history])
    assert history.history["promotions"] == [
        {"layer": "hot", "reason": promote.FORWARD, "step": 0}
    ]
    run = event_accumulator.EventAccumulator(
        os.path.join(log_dir, "tf_als"), size_guidance={event_accumulator.TENSORS: 0}
    )
    run.Reload()
    (event,) = run.Tensors(tf_als.callbacks.PROMOTIONS_TAG)
    assert event.step == 0
    text = tf.make_ndarray(event.tensor_proto).item().decode()
    assert text == f"layer 'hot' promoted to float32 at step 0: {promote.FORWARD}"


def test_promotions_survive_a_checkpoint(tmp_path):
    """A checkpoint holds variables, not dtype policies: the promotions
    travel in the model's `promotion_log` and are re-applied by `fit` (and
    `tf_als.promoted`) after the restore."""
    x, y = data()
    model = tf_als.instrument(build())
    model.compile(optimizer(), loss_fn())
    with pytest.warns(UserWarning, match="promoted"):
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        os.path.join(tmp_path, "ckpt")
    )
    fresh = tf_als.instrument(build())
    fresh.compile(optimizer(), loss_fn())
    fresh.optimizer.build(fresh.trainable_variables)
    status = tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(path)
    status.assert_existing_objects_matched()
    assert fresh.model.get_layer("hot").compute_dtype == "float16"  # not yet
    assert tf_als.promoted(fresh) == tf_als.promoted(model)
    assert fresh.model.get_layer("hot").compute_dtype == "float32"
    np.testing.assert_array_equal(fresh.predict(x, verbose=0), model.predict(x, verbose=0))
    before = int(fresh.optimizer.iterations.numpy())
    fresh.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert int(fresh.optimizer.iterations.numpy()) == before + 4


MIRRORED_PROMOTION = """
import tensorflow as tf
(cpu,) = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import sys, warnings
sys.path.insert(0, {tests!r})
import keras
import numpy as np
keras.mixed_precision.set_global_policy("mixed_float16")
import tf_als
from {module} import BATCH, build, data, loss_fn, optimizer
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    model = tf_als.instrument(build())
    model.compile(optimizer(), loss_fn())
x, y = data()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    history = model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False)
print("PROMOTED", [(p.layer, p.step) for p in tf_als.promoted(model)])
print("ITERATIONS", int(model.optimizer.iterations.numpy()))
print("FINITE", bool(np.all(np.isfinite(history.history["loss"][1:]))))
for v in model.model.weights:
    values = [r.numpy() for r in strategy.experimental_local_results(v)]
    assert all(np.array_equal(values[0], r) for r in values[1:]), v.path
print("REPLICAS_EQUAL", True)
"""


@pytest.mark.slow  # ~30 s each: a subprocess that starts TensorFlow again
@pytest.mark.parametrize(
    "module, layer, skips",
    [("test_promote", "hot", SKIPS), ("test_promote_backward", "temperature", 4)],
    ids=["forward", "backward"],
)
def test_mirrored_replicas_promote_the_same_layer_at_the_same_step(module, layer, skips):
    """Two logical CPUs (in a subprocess: devices must be split before
    TensorFlow starts). Promotion happens on the host, on the one layer
    object every replica runs, so both replicas compute the layer (`hot`,
    whose forward pass fails in float16, or `temperature`, whose backward
    pass does) in float32 from the same step on and end with equal
    weights."""
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run(
        [sys.executable, "-c", MIRRORED_PROMOTION.format(tests=tests, module=module)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    lines = dict(
        line.split(" ", 1) for line in result.stdout.splitlines()
        if line.split(" ", 1)[0] in ("PROMOTED", "ITERATIONS", "FINITE", "REPLICAS_EQUAL")
    )
    assert "REPLICAS_EQUAL" in lines, result.stderr[-3000:]
    assert lines["PROMOTED"] == f"[('{layer}', 0)]"
    assert lines["ITERATIONS"] == str(3 * 4 - skips)
    assert lines["FINITE"] == "True"
