"""Self-healing float16 (`promote_on_storm`): a layer whose float16 forward
pass overflows is switched to float32, and the run trains on.

The model: first -> hot -> head (float32 output). `hot` is a Dense with a
softmax and a bias of 1e5 on every unit (a large common offset, which softmax
ignores): its float16 logits overflow to inf and the softmax turns them into
NaN, while float32 holds them and its softmax output, in [0, 1], fits float16
again. No loss scale can cure that; promoting `hot` can.

When `hot` overflows from the start, `fit` finds it on the first batch
(`preflight`) and promotes it before the first step: nothing is
skipped. The storm triggers (`max_consecutive_skips` skips in a row, or as
many within twice that many steps) are for failures that appear later: the
tests arm `hot` during training (`Schedule`).
"""

import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tf_als._src.failures import forward_search
from tf_als._src.monitoring import callbacks as callbacks_module
from tf_als._src.failures import backward_search
from tf_als._src.failures import preflight
from tf_als._src.failures import promote
from tf_als._src.scaling import rule
from tests.modes import JIT_COMPILE

layers = keras.layers
pytestmark = pytest.mark.usefixtures("mixed")

STEPS = 60
BATCH = 16
SKIPS = 3


def build(policy=None, armed=True, promoted=()):
    """The model under `policy` (the global one when None), with fixed
    weights; `hot` overflows when `armed`; the layers named in `promoted`
    compute in float32 (the manual fix)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))

    def dtype(name):
        return "float32" if name in promoted else policy

    x = layers.Dense(16, name="first", dtype=dtype("first"))(inputs)
    x = layers.Dense(16, activation="softmax", name="hot", dtype=dtype("hot"))(x)
    outputs = layers.Dense(4, dtype="float32", name="head")(x)
    model = keras.Model(inputs, outputs)
    if armed:
        arm(model)
    return model


def arm(plain):
    """A common offset of 1e5 on `hot`'s logits: past float16's maximum."""
    hot = plain.get_layer("hot")
    hot.bias.assign(hot.bias + 1e5)


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * 4, 8)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + 2 * (x[:, 1] > 0).astype("int32")


def batches_of(x, y):
    """`fit`'s batches of `x, y` (shuffle=False), as `(x, y, None)`."""
    return [(x[i : i + BATCH], y[i : i + BATCH], None) for i in range(0, len(x), BATCH)]


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def search_loss(x, y, y_pred, sample_weight):
    return loss_fn()(y, y_pred)


def optimizer(**kwargs):
    kwargs.setdefault("max_consecutive_skips", SKIPS)
    return tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-2), **kwargs)


def largest_finite_scale(plain, loss, batches, top=2.0**15):
    """The largest power of two at most `top` at which every one of
    `batches` has finite gradients (`backward_search`, eagerly, on `plain`
    as it is now), trying `top`, `top / 2`, ... down to
    `rule.MIN_SCALE`; None when there is none."""
    exponent = math.floor(math.log2(top))
    while 2.0**exponent >= rule.MIN_SCALE:
        if all(
            backward_search.first_non_finite_gradient(plain, loss, b, 2.0**exponent)
            is None
            for b in batches
        ):
            return 2.0**exponent
        exponent -= 1
    return None


class Schedule(keras.callbacks.Callback):
    """Runs `actions[i]()` before the i-th batch of `fit` (counted over
    epochs), and records, before the first batch after each promotion, the
    global scale and `largest_finite_scale` of `batches` on the model as it
    is then (its weights and dtype policies are those the promotion's
    preflight saw: skipped steps change nothing). `scales[k]` is the global
    scale before batch k."""

    def __init__(self, actions, batches=(), loss=search_loss):
        super().__init__()
        self.actions, self.batches, self.loss = actions, batches, loss
        self.count, self.scales, self.after_promotion = 0, [], []
        self._promotions = 0

    def on_train_batch_begin(self, batch, logs=None):
        promotions = tf_als.promoted(self.model)
        if len(promotions) > self._promotions:
            self._promotions = len(promotions)
            self.after_promotion.append(
                (
                    float(self.model.optimizer.dynamic_scale.numpy()),
                    largest_finite_scale(self.model.uninstrumented(), self.loss, self.batches),
                )
            )
        action = self.actions.get(self.count)
        if action is not None:
            action()
        self.scales.append(float(self.model.optimizer.dynamic_scale.numpy()))
        self.count += 1


def float32_loss(x, y, steps, seed=0):
    """float32's loss on `x, y` after `steps` Adam steps on `fit`'s batches
    in order (shuffle=False)."""
    reference = build("float32", armed=False)
    reference.compile(keras.optimizers.Adam(1e-2), loss_fn())
    batches = batches_of(x, y)
    for i in range(steps):
        xb, yb, _ = batches[i % len(batches)]
        reference.train_on_batch(xb, yb)
    return reference.evaluate(x, y, verbose=0)


def test_the_model_overflows_in_float16_only():
    x, y = data()
    assert np.all(np.isfinite(build("float32")(x)))
    assert not np.all(np.isfinite(build()(x)))
    assert forward_search.first_non_finite_output(build(), x) == "hot"
    # The preflight's forward check names it, and only it; unarmed, nothing.
    assert preflight.forward_failures(build(), (x, y, None)) == [
        preflight.Failure("hot", promote.FORWARD)
    ]
    assert preflight.forward_failures(build(armed=False), (x, y, None)) == []


@pytest.mark.parametrize("jit_compile", JIT_COMPILE)
def test_fit_promotes_the_layer_before_the_first_step_and_trains_like_float32(jit_compile):
    """`hot` overflows from the start: `fit` promotes it on the first batch,
    before the first step, so no step is skipped, and chooses the global
    scale: the largest power of two <= 2**15 at which the first batch's
    gradients are finite with `hot` in float32 (2**15 here). Its loss after
    all STEPS steps is within 2% of float32's after the same steps (the
    issue's bound): float16 rounding in `first` is all that differs
    (measured: 0.76655, XLA on and off, against float32's 0.76832, from
    1.40 at the start)."""
    x, y = data()
    model = tf_als.instrument(build())
    model.compile(optimizer(), loss_fn(), jit_compile=jit_compile)
    with pytest.warns(UserWarning, match="promoted layer 'hot' to float32 at step 0"):
        model.fit(x, y, batch_size=BATCH, epochs=STEPS // 4, verbose=0, shuffle=False)
    assert tf_als.promoted(model) == [
        promote.Promotion(layer="hot", reason=promote.FORWARD, step=0)
    ]
    assert model.uninstrumented().get_layer("hot").compute_dtype == "float32"
    assert model.uninstrumented().get_layer("first").compute_dtype == "float16"
    assert int(model.optimizer.iterations.numpy()) == STEPS  # nothing skipped
    expected_scale = largest_finite_scale(
        build(promoted={"hot"}), search_loss, batches_of(x, y)[:1]
    )
    assert float(model.optimizer.dynamic_scale.numpy()) == expected_scale

    expected = float32_loss(x, y, STEPS)
    got = model.evaluate(x, y, verbose=0)
    assert np.isfinite(got)
    assert abs(got - expected) <= 0.02 * expected, (got, expected)


def test_a_storm_later_in_the_run_promotes_and_recalibrates_the_scale():
    """`hot` is healthy at the first batch (the preflight promotes nothing),
    overflows once at batch 1 (one skip: the global scale halves to 2**14)
    and for good from batch 9, whose skip is the second with a loss that
    is not finite: the check promotes `hot` then, at step 8 (the steps
    applied before it; SKIPS skips, a storm, before that check) and re-calibrates
    the global scale on the training batches: the largest power of two
    <= 2**15 at which all of them have finite gradients (2**15), not the
    2**14 it had before the skips. No later step is skipped, and the run
    ends finite, below its starting loss."""
    x, y = data()
    plain = build(armed=False)
    model = tf_als.instrument(plain)
    model.compile(optimizer(), loss_fn())
    hot = plain.get_layer("hot")
    saved = []
    schedule = Schedule(
        {
            1: lambda: (saved.append(hot.bias.numpy()), arm(plain)),
            2: lambda: hot.bias.assign(saved[0]),
            9: lambda: arm(plain),
        },
        batches=batches_of(x, y),
    )
    start = model.evaluate(x, y, verbose=0)
    epochs = 6
    with pytest.warns(UserWarning, match="promoted layer 'hot' to float32 at step 8"):
        model.fit(
            x, y, batch_size=BATCH, epochs=epochs, verbose=0, shuffle=False,
            callbacks=[schedule],
        )
    assert tf_als.promoted(model) == [
        promote.Promotion(layer="hot", reason=promote.FORWARD, step=8)
    ]
    assert int(model.optimizer.iterations.numpy()) == 4 * epochs - 2  # Batches 1, 9.
    before_the_storm = schedule.scales[9]
    assert before_the_storm == 2.0**14
    ((scale, recalibrated),) = schedule.after_promotion
    assert recalibrated != before_the_storm  # the test tells the two apart
    assert scale == recalibrated
    # And it held: no skip after the promotion.
    assert set(schedule.scales[12:]) == {recalibrated}
    got = model.evaluate(x, y, verbose=0)
    assert np.isfinite(got) and got < start, (got, start)


def test_evaluate_and_predict_after_a_promotion_compute_the_layer_in_float32():
    """Keras traces `evaluate`'s and `predict`'s functions once and keeps
    them; a promotion changes what they must compute. A model evaluated
    before `fit` (a baseline: NaN, `hot` overflows) and promoted by it
    predicts and evaluates afterwards as the manual fix does with the same
    weights."""
    x, y = data()
    model = tf_als.instrument(build())
    model.compile(optimizer(), loss_fn())
    assert not np.isfinite(model.evaluate(x, y, verbose=0))
    assert not np.all(np.isfinite(model.predict(x, verbose=0)))
    with pytest.warns(UserWarning, match="promoted layer 'hot'"):
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    fix = build(promoted={"hot"}, armed=False)
    fix.set_weights(model.uninstrumented().get_weights())
    fix.compile(loss=loss_fn())
    np.testing.assert_array_equal(model.predict(x, verbose=0), fix.predict(x, verbose=0))
    assert model.evaluate(x, y, verbose=0) == fix.evaluate(x, y, verbose=0)


def test_off_it_stops_as_before():
    x, y = data()
    model = tf_als.instrument(build())
    model.compile(optimizer(promote_on_storm=False), loss_fn())
    with pytest.raises(tf_als.NonFiniteStormError, match="not finite: 'hot'"):
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    assert tf_als.promoted(model) == []


def custom_loop(model, opt, loss, xb, yb, steps, check, compiled=True, before=None,
                promoted_hook=None):
    """Trains `steps` steps on one batch in a custom loop, calling
    `before(i)` (if given) before step i and `check(opt, xb, yb)` (a
    `check_skips` call) after it, and making the compiled step again when it
    promoted (then calling `promoted_hook(made)`); returns the
    promotions."""

    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(loss(yb, model(xb, training=True)))
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)

    make = tf.function if compiled else (lambda f: f)
    step, promoted = make(train_step), []
    for i in range(steps):
        if before is not None:
            before(i)
        step(xb, yb)
        made = check(opt, xb, yb)
        if made:
            promoted += made
            step = make(train_step)
            if promoted_hook is not None:
                promoted_hook(made)
    return promoted


def test_a_compiled_custom_loop_promotes_through_check_skips():
    """Without `loss`, check_skips runs no preflight: the loop skips two
    steps, whose first loss was not finite, and the check re-runs the
    inputs forward, promotes `hot`, and puts the global scale back where
    it was before the skips (nothing to re-calibrate it on without the
    loss). Before the check of a non-finite loss it took SKIPS, a storm."""
    x, y = data()
    model = tf_als.instrument(build())
    opt = optimizer()
    promoted = custom_loop(
        model, opt, loss_fn(), x[:BATCH], y[:BATCH], 8,
        lambda opt, xb, yb: opt.check_skips(batches=lambda: [xb]),
    )
    assert promoted == [promote.Promotion(layer="hot", reason=promote.FORWARD, step=0)]
    assert int(opt.iterations.numpy()) == 8 - 2
    assert float(opt.dynamic_scale.numpy()) == 2.0**15


def test_a_custom_loop_that_checks_with_the_loss_promotes_at_its_first_check():
    """With `loss`, the first check_skips (after the loop's first step,
    which the overflow skips) runs the preflight `fit` runs: one step lost,
    not SKIPS, and the global scale chosen on the batch."""
    x, y = data()
    model = tf_als.instrument(build())
    opt = optimizer()
    scales = []
    promoted = custom_loop(
        model, opt, loss_fn(), x[:BATCH], y[:BATCH], 8,
        lambda opt, xb, yb: opt.check_skips(batches=lambda: [(xb, yb)], loss=loss_fn()),
        promoted_hook=lambda made: scales.append(
            (
                float(opt.dynamic_scale.numpy()),
                largest_finite_scale(
                    model.uninstrumented(), search_loss, [(x[:BATCH], y[:BATCH], None)]
                ),
            )
        ),
    )
    assert promoted == [promote.Promotion(layer="hot", reason=promote.FORWARD, step=0)]
    assert int(opt.iterations.numpy()) == 8 - 1
    ((scale, expected),) = scales
    assert scale == expected


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
    assert loaded.uninstrumented().get_layer("hot").compute_dtype == "float32"
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    # Training resumes without skipping.
    before = int(loaded.optimizer.iterations.numpy())
    loaded.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == before + 4


class _Hot(layers.Layer):
    """softmax(x + b) with b = 1e5 on every unit: float16's b is inf, and
    the output NaN; float32's is finite."""

    def build(self, input_shape):
        self.b = self.add_weight(
            shape=(input_shape[-1],), initializer=keras.initializers.Constant(1e5),
            name="b",
        )

    def call(self, x):
        return keras.ops.softmax(x + keras.ops.cast(self.b, x.dtype))


# Five layer classes that fail the same way: five distinct failures.
HOT_CLASSES = [type(f"Hot{k}", (_Hot,), {}) for k in range(5)]


def branches(classes):
    """first -> one branch per class of `classes` (named hot0, hot1, ...),
    side by side -> concatenated -> head (float32). Every branch overflows
    on finite inputs, so one forward check finds them all."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = layers.Dense(16, name="first")(inputs)
    outputs = [cls(name=f"hot{k}")(h) for k, cls in enumerate(classes)]
    x = layers.Concatenate()(outputs)
    return keras.Model(inputs, layers.Dense(4, dtype="float32", name="head")(x))


def test_past_the_cap_of_distinct_failures_it_stops_listing_what_it_promoted():
    """Five failing layers of five classes: five distinct failures, one past
    `MAX_FAILURES` (4). The preflight promotes the first four before the
    first step; the fifth keeps overflowing, and the storm error states the
    cap and what was promoted."""
    assert promote.MAX_FAILURES == 4
    x, y = data()
    model = tf_als.instrument(branches(HOT_CLASSES))
    model.compile(optimizer(), loss_fn())
    with pytest.raises(tf_als.NonFiniteStormError) as caught:
        with pytest.warns(UserWarning, match="promoted layer 'hot0'"):
            model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    message = str(caught.value)
    assert (
        f"layer 'hot4' would also need float32 ({promote.FORWARD}), past the cap "
        "of 4 distinct failures" in message
    ), message
    assert "promoted so far: 'hot0', 'hot1', 'hot2', 'hot3'" in message
    assert tf_als.promoted(model) == [
        promote.Promotion(layer=f"hot{k}", reason=promote.FORWARD, step=0)
        for k in range(4)
    ]
    assert promote.failures(model) == {
        (f"Hot{k}", promote.FORWARD) for k in range(4)
    }
    assert model.uninstrumented().get_layer("hot4").compute_dtype == "float16"


def test_the_cap_counts_failures_not_layers():
    """Five failing layers of four classes (two `Hot0`s): four distinct
    failures, within the cap. All five are promoted before the first step,
    and nothing is skipped."""
    x, y = data()
    model = tf_als.instrument(branches(HOT_CLASSES[:4] + HOT_CLASSES[:1]))
    model.compile(optimizer(), loss_fn())
    with pytest.warns(UserWarning, match="promoted layer 'hot4'"):
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    assert tf_als.promoted(model) == [
        promote.Promotion(layer=f"hot{k}", reason=promote.FORWARD, step=0)
        for k in range(5)
    ]
    assert len(promote.failures(model)) == 4
    assert int(model.optimizer.iterations.numpy()) == 2 * 4


def test_two_failing_layers_of_one_class_are_one_failure_promoted_together():
    """`hot` -> `hotter`, two Dense layers whose kernels (x 1e6) overflow
    float16: one failure (Dense, forward). Both are promoted before the
    first step (the second once the first no longer hands it NaN), nothing
    is skipped, and the loss after STEPS steps is within 2% of float32's
    (measured: 1.25743, float32's to the last digit: every layer with
    weights now computes in float32)."""

    def two_hot(policy=None):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        x = layers.Dense(16, activation="softmax", name="hot", dtype=policy)(inputs)
        x = layers.Dense(16, activation="softmax", name="hotter", dtype=policy)(x)
        outputs = layers.Dense(4, dtype="float32", name="head")(x)
        plain = keras.Model(inputs, outputs)
        for name in ("hot", "hotter"):
            layer = plain.get_layer(name)
            layer.kernel.assign(layer.kernel * 1e6)
        return plain

    x, y = data()
    model = tf_als.instrument(two_hot())
    model.compile(optimizer(), loss_fn())
    with pytest.warns(UserWarning, match="promoted layer 'hotter'"):
        model.fit(x, y, batch_size=BATCH, epochs=STEPS // 4, verbose=0, shuffle=False)
    assert tf_als.promoted(model) == [
        promote.Promotion(layer=name, reason=promote.FORWARD, step=0)
        for name in ("hot", "hotter")
    ]
    assert promote.failures(model) == {("Dense", promote.FORWARD)}
    assert int(model.optimizer.iterations.numpy()) == STEPS

    reference = two_hot("float32")
    reference.compile(keras.optimizers.Adam(1e-2), loss_fn())
    reference.fit(x, y, batch_size=BATCH, epochs=STEPS // 4, verbose=0, shuffle=False)
    expected = reference.evaluate(x, y, verbose=0)
    got = model.evaluate(x, y, verbose=0)
    assert abs(got - expected) <= 0.02 * expected, (got, expected)


def test_a_layer_that_fails_in_float32_too_is_not_promoted():
    """`boom` (tests/failures/test_storms.py) emits inf in its backward pass in any
    dtype: promoting it cannot help, so it stays float16, and the storm
    error says why."""
    from tests.failures import test_storms

    model, plain, opt = test_storms.build(max_consecutive_skips=2)
    model.compile(opt, "mse")
    x, y = test_storms.batch(size=4 * test_storms.BATCH)
    test_storms.arm(plain)
    with pytest.raises(
        tf_als.NonFiniteStormError, match="layer 'boom' .*promoting it cannot help"
    ):
        model.fit(x, y, batch_size=test_storms.BATCH, epochs=2, verbose=0)
    assert tf_als.promoted(model) == []
    assert plain.get_layer("boom").compute_dtype == "float16"


def test_a_healthy_run_is_bitwise_unchanged():
    """promote_on_storm runs the preflight on the first batch; on a model
    whose first batch has finite gradients at 2**15 (the initial scale) it
    promotes nothing and keeps the scale, and the run is bitwise the run
    without it."""
    x, y = data()

    def healthy():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((8,))
        h = layers.Dense(16, activation="relu")(inputs)
        outputs = layers.Dense(4, dtype="float32")(h)
        return keras.Model(inputs, outputs)

    assert largest_finite_scale(healthy(), search_loss, batches_of(x, y)[:1]) == 2.0**15
    results = []
    for flag in (True, False):
        model = tf_als.instrument(healthy())
        model.compile(optimizer(promote_on_storm=flag), loss_fn())
        model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False)
        assert tf_als.promoted(model) == []
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
    (event,) = run.Tensors(callbacks_module.PROMOTIONS_TAG)
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
    assert fresh.uninstrumented().get_layer("hot").compute_dtype == "float16"  # not yet
    assert tf_als.promoted(fresh) == tf_als.promoted(model)
    assert fresh.uninstrumented().get_layer("hot").compute_dtype == "float32"
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
print("FINITE", bool(np.all(np.isfinite(history.history["loss"]))))
for v in model.uninstrumented().weights:
    values = [r.numpy() for r in strategy.experimental_local_results(v)]
    assert all(np.array_equal(values[0], r) for r in values[1:]), v.path
print("REPLICAS_EQUAL", True)
"""


@pytest.mark.slow  # ~30 s each: a subprocess that starts TensorFlow again
@pytest.mark.parametrize(
    "module, layer",
    [("test_promote", "hot"), ("test_promote_backward", "temperature")],
    ids=["forward", "backward"],
)
def test_mirrored_replicas_promote_the_same_layer_at_the_same_step(module, layer):
    """Two logical CPUs (in a subprocess: devices must be split before
    TensorFlow starts). Promotion happens on the host, on the one layer
    object every replica runs, so both replicas compute the layer (`hot`,
    whose forward pass fails in float16, or `temperature`, whose backward
    pass does) in float32 from the same step on and end with equal
    weights. The failure is there from the first batch: `fit` promotes
    before the first step, and no step is skipped."""
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
    assert lines["ITERATIONS"] == str(3 * 4)
    assert lines["FINITE"] == "True"
