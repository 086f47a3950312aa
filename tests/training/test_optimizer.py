"""Tests of `tf_als.AdaptiveLossScaleOptimizer` that need no instrumented
model: it is a `keras.optimizers.LossScaleOptimizer` with four more knobs,
validated arguments, a config that extends the parent's, and, on a model
that was not instrumented, exactly the parent's behaviour (bitwise).
"""

import copy
import json
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als

ALS = tf_als.AdaptiveLossScaleOptimizer
LSO = keras.optimizers.LossScaleOptimizer


NEW_DEFAULTS = dict(
    rule="amax",
    telemetry_interval=100,
    update_interval=100,
    underflow_rate=0.01,
    max_layer_scale=2.0**15,
    overflow_margin=2.0**12,
    max_consecutive_skips=32,
    promote_on_storm=True,
)


# --------------------------------------------------------------------------
# Class, defaults
# --------------------------------------------------------------------------


def test_is_a_keras_loss_scale_optimizer():
    assert issubclass(ALS, LSO)
    optimizer = ALS(keras.optimizers.SGD())
    assert isinstance(optimizer, LSO)
    assert isinstance(optimizer, keras.optimizers.Optimizer)


def test_defaults():
    inner = keras.optimizers.SGD()
    optimizer = ALS(inner)
    for name, value in NEW_DEFAULTS.items():
        assert getattr(optimizer, name) == value, name
        assert type(getattr(optimizer, name)) is type(value), name
    # The parent's defaults, read from the parent itself.
    parent = LSO(keras.optimizers.SGD())
    assert optimizer.initial_scale == parent.initial_scale == 2.0**15
    assert optimizer.dynamic_growth_steps == parent.dynamic_growth_steps == 2000
    assert optimizer.inner_optimizer is inner


def test_disables_the_inner_loss_scale_factor():
    # As the parent: the inner optimizer must not scale again.
    inner = keras.optimizers.SGD(loss_scale_factor=4.0)
    ALS(inner)
    assert inner.loss_scale_factor is None


def test_knobs_are_stored():
    optimizer = ALS(
        keras.optimizers.Adam(),
        initial_scale=2.0**10,
        dynamic_growth_steps=7,
        rule="paper",
        update_interval=3,
        telemetry_interval=5,
        underflow_rate=0.05,
        max_layer_scale=2**10,
        overflow_margin=1,
        name="als",
    )
    assert optimizer.initial_scale == 2.0**10
    assert optimizer.dynamic_growth_steps == 7
    assert optimizer.rule == "paper"
    assert optimizer.update_interval == 3
    assert optimizer.telemetry_interval == 5
    assert optimizer.underflow_rate == 0.05
    assert optimizer.max_layer_scale == 2.0**10
    assert optimizer.overflow_margin == 1.0
    assert optimizer.name == "als"


def test_builds_the_parent_state():
    # Variables as the parent builds them: S at initial_scale, counter 0,
    # inner iterations 0.
    optimizer = ALS(keras.optimizers.SGD(), initial_scale=2.0**9)
    optimizer.build([keras.Variable(np.zeros([2], np.float32))])
    assert float(optimizer.dynamic_scale.numpy()) == 2.0**9
    assert int(optimizer.step_counter.numpy()) == 0
    assert int(optimizer.iterations.numpy()) == 0
    assert float(optimizer.scale_loss(tf.constant(3.0)).numpy()) == 3.0 * 2**9


# --------------------------------------------------------------------------
# Bad input: every argument, with a message naming it and the value
# --------------------------------------------------------------------------


def _names(argument, value):
    """A regex matching a message that names `argument` and later shows
    `value` (its repr) as a whole token, so that e.g. 3 does not match
    inside 32768."""
    return re.escape(argument) + r"[\s\S]*(?<![\w.])" + re.escape(repr(value)) + r"(?!\w)"


@pytest.mark.parametrize(
    "argument, value",
    [
        ("update_interval", 0),
        ("update_interval", -3),
        ("update_interval", 1.5),
        ("update_interval", True),
        ("update_interval", "100"),
        ("telemetry_interval", 0),
        ("telemetry_interval", 2.5),
        ("telemetry_interval", "10"),
        ("rule", "quantile"),
        ("rule", None),
        ("underflow_rate", -0.1),
        ("underflow_rate", 1.0),
        ("underflow_rate", "x"),
        ("underflow_rate", True),
        ("underflow_rate", float("nan")),
        ("max_layer_scale", 3),
        ("max_layer_scale", 0.5),
        ("max_layer_scale", 2**16),
        ("max_layer_scale", 0),
        ("max_layer_scale", float("inf")),
        ("overflow_margin", 3),
        ("overflow_margin", 0.25),
        ("overflow_margin", 2**16),
        ("initial_scale", 0),
        ("initial_scale", -1.0),
        ("initial_scale", float("inf")),
        ("initial_scale", float("nan")),
        ("dynamic_growth_steps", 0),
        ("dynamic_growth_steps", 2.5),
    ],
)
def test_rejects_bad_argument(argument, value):
    with pytest.raises(ValueError, match=_names(argument, value)):
        ALS(keras.optimizers.SGD(), **{argument: value})


def test_rejects_inner_optimizer_string():
    with pytest.raises(TypeError, match=_names("inner_optimizer", "adam")):
        ALS("adam")


@pytest.mark.parametrize("wrapper", [LSO, ALS], ids=["keras", "tf_als"])
def test_rejects_inner_loss_scale_optimizer(wrapper):
    inner = wrapper(keras.optimizers.SGD())
    match = re.escape("inner_optimizer") + r"[\s\S]*" + wrapper.__name__
    with pytest.raises(ValueError, match=match):
        ALS(inner)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        # The parent refuses base optimizer arguments it would not honour...
        (dict(clipnorm=1.0), "clipnorm"),
        (dict(global_clipnorm=1.0), "global_clipnorm"),
        (dict(use_ema=True), "use_ema"),
        (dict(loss_scale_factor=2.0), "loss_scale_factor"),
        # ...and unknown ones.
        (dict(not_an_argument=1), "not_an_argument"),  # (tf_als: suggests)
        (dict(dynamic=False), "dynamic"),
    ],
)
def test_parent_rejects_unsupported_kwargs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LSO(keras.optimizers.SGD(), **kwargs)
    with pytest.raises(ValueError, match=match):
        ALS(keras.optimizers.SGD(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, suggestion",
    [
        (dict(update_intervall=10), "update_interval"),
        (dict(max_layer_scal=2.0**10), "max_layer_scale"),
        (dict(overflowmargin=2.0**10), "overflow_margin"),
        (dict(initial_scal=2.0**10), "initial_scale"),
        (dict(completely_unrelated=1), None),
    ],
)
def test_unknown_keyword_names_the_class_and_suggests(kwargs, suggestion):
    (key,) = kwargs
    hint = f" Did you mean `{suggestion}`\\?" if suggestion else " Its arguments"
    with pytest.raises(
        ValueError,
        match=f"AdaptiveLossScaleOptimizer got an unexpected keyword argument `{key}`.{hint}",
    ):
        ALS(keras.optimizers.SGD(), **kwargs)


def test_every_unexpected_keyword_is_named():
    # As Keras names all of them ("arguments: `foo`, `bar`"), with the
    # closest argument for each that has one, in the order given.
    with pytest.raises(ValueError) as caught:
        ALS(keras.optimizers.SGD(), foo=True, update_intervall=3, bar=3)
    message = str(caught.value)
    assert "unexpected keyword arguments: `foo`, `update_intervall`, `bar`." in message
    assert "Did you mean `update_interval` for `update_intervall`?" in message
    assert "Its arguments: inner_optimizer, initial_scale," in message
    # A known parent keyword among them is left to the parent's check.
    with pytest.raises(ValueError, match=r"arguments: `foo`, `bar`\. Its"):
        ALS(keras.optimizers.SGD(), foo=True, clipnorm=None, bar=3)


def test_warns_once_on_a_model_that_was_not_instrumented(mixed):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = ALS(keras.optimizers.SGD())
    model.compile(optimizer=optimizer, loss="mse")
    x, y = np.ones((4, 3), "float32"), np.ones((4, 2), "float32")
    with pytest.warns(UserWarning, match="not instrumented: per-layer scaling is off") as caught:
        model.fit(x, y, epochs=2, batch_size=2, verbose=0)
    assert len([w for w in caught if "not instrumented" in str(w.message)]) == 1


def test_does_not_warn_on_an_instrumented_model(mixed):
    model = tf_als.instrument(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    model.compile(optimizer=ALS(keras.optimizers.SGD()), loss="mse")
    x, y = np.ones((4, 3), "float32"), np.ones((4, 2), "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.fit(x, y, epochs=1, batch_size=2, verbose=0)


def test_accepts_parent_default_kwargs():
    # Old configs carry the parent's non-functional defaults; the parent
    # accepts them and so must the subclass.
    ALS(keras.optimizers.SGD(), clipnorm=None, use_ema=False, dynamic=True)


def test_accepts_edge_values():
    # The valid extremes of each range.
    optimizer = ALS(
        keras.optimizers.SGD(),
        update_interval=1,
        underflow_rate=0.0,
        max_layer_scale=1,
        overflow_margin=2**15,
        initial_scale=1e-3,
        dynamic_growth_steps=1,
    )
    assert optimizer.max_layer_scale == 1.0
    assert optimizer.overflow_margin == 2.0**15
    ALS(keras.optimizers.SGD(), max_layer_scale=2.0**15, underflow_rate=0.999)
    ALS(keras.optimizers.SGD(), update_interval=np.int64(5))


# --------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------

CUSTOM = dict(
    initial_scale=2.0**10,
    dynamic_growth_steps=3,
    rule="paper",
    telemetry_interval=9,
    update_interval=7,
    underflow_rate=0.05,
    max_layer_scale=2.0**10,
    overflow_margin=2.0**6,
    max_consecutive_skips=5,
    promote_on_storm=False,
    name="als",
)


def test_config_extends_the_parents():
    # Explicit inner name: Keras uniquifies default optimizer names.
    inner = dict(learning_rate=0.125, momentum=0.5, name="inner")
    parent_config = LSO(
        keras.optimizers.SGD(**inner),
        initial_scale=2.0**10,
        dynamic_growth_steps=3,
        name="als",
    ).get_config()
    config = ALS(keras.optimizers.SGD(**inner), **CUSTOM).get_config()
    assert set(config) == set(parent_config) | set(NEW_DEFAULTS)
    assert set(NEW_DEFAULTS).isdisjoint(parent_config)
    # The parent's keys keep their names and values.
    for key, value in parent_config.items():
        assert config[key] == value, key
    for key in NEW_DEFAULTS:
        assert config[key] == CUSTOM[key], key
    json.dumps(config)  # plain Python values only


def test_default_config_values():
    config = ALS(keras.optimizers.SGD()).get_config()
    for key, value in NEW_DEFAULTS.items():
        assert config[key] == value, key
    assert config["initial_scale"] == 2.0**15
    assert config["dynamic_growth_steps"] == 2000


def test_from_config_round_trip():
    optimizer = ALS(keras.optimizers.Adam(learning_rate=0.25, beta_1=0.5), **CUSTOM)
    config = optimizer.get_config()
    restored = ALS.from_config(copy.deepcopy(config))
    assert type(restored) is ALS
    assert restored.get_config() == config
    assert type(restored.inner_optimizer) is keras.optimizers.Adam
    assert restored.inner_optimizer is not optimizer.inner_optimizer
    assert restored.update_interval == 7
    assert type(restored.update_interval) is int
    assert restored.rule == "paper" and restored.telemetry_interval == 9


def test_an_old_update_interval_becomes_the_telemetry_interval():
    """Until 0.3 `update_interval` also set how often statistics were
    recorded. A 0.2 config (no `rule`, no `telemetry_interval`) that set it
    keeps that cadence for the telemetry, and says so; the default, or
    the paper's rule (which still updates on it), says nothing."""
    old = ALS(keras.optimizers.SGD(), update_interval=10).get_config()
    del old["rule"], old["telemetry_interval"]
    with pytest.warns(DeprecationWarning, match="telemetry_interval"):
        restored = ALS.from_config(old)
    assert restored.telemetry_interval == 10 and restored.update_interval == 10
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ALS(keras.optimizers.SGD()).telemetry_interval == 100
        paper = ALS(keras.optimizers.SGD(), rule="paper", update_interval=10)
        assert paper.telemetry_interval == 100
        both = ALS(keras.optimizers.SGD(), update_interval=10, telemetry_interval=3)
        assert both.telemetry_interval == 3


def test_a_model_whose_pass_used_other_knobs_is_refused(mixed):
    """A custom loop whose model was never compiled with the optimizer:
    the backward pass ran with the default knobs before the optimizer's
    `apply` could hand it its own, so the first `apply` refuses, naming
    both and the fix; compiling first makes the same loop run."""
    def build():
        inputs = keras.Input((4,))
        model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
        return tf_als.instrument(model)

    x = tf.ones((2, 4))

    def step(model, optimizer):
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(tf.reduce_sum(model(x, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    model = build()
    optimizer = ALS(keras.optimizers.SGD(0.0), overflow_margin=2**6)
    with pytest.raises(ValueError, match=r"overflow_margin=4096\.0[\s\S]*overflow_margin=64\.0[\s\S]*model\.compile"):
        step(model, optimizer)
    model = build()
    model.compile(optimizer=optimizer)
    step(model, optimizer)
    assert model.scaling_config.overflow_margin == 64.0


def test_a_second_instrumentation_of_the_same_layers_is_named_in_the_refusal(mixed):
    """Instrumenting one model twice gives two models over the same
    variables; the optimizer finds both (`owners`), and the one never
    compiled with it keeps the default knobs. Under `rule="paper"` the
    step is refused with a message that names that case (the replication
    benchmark's underflow probe hit it, and the message named only the
    custom-loop cause). The refusal comes before the optimizer builds its
    variables: made inside the refused trace, they were left unmade, and
    every later step applied nothing, silently (its scale read as an empty
    array). Compiled again, with the second model compiled alike, the
    model trains."""
    inputs = keras.Input((4,))
    base = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model, second = tf_als.instrument(base), tf_als.instrument(base)
    optimizer = ALS(keras.optimizers.SGD(0.0), rule="paper")
    model.compile(optimizer=optimizer, loss="mse")
    x, y = np.ones((2, 4), "float32"), np.zeros((2, 2), "float32")
    with pytest.raises(ValueError, match=r"rule='amax'[\s\S]*rule='paper'[\s\S]*second `tf_als\.instrument`"):
        model.train_on_batch(x, y)
    assert not optimizer.built
    second.compile(optimizer=ALS(keras.optimizers.SGD(0.0), rule="paper"), loss="mse")
    model.compile(optimizer=optimizer, loss="mse")
    model.train_on_batch(x, y)
    assert int(optimizer.iterations.numpy()) == 1
    assert float(keras.ops.convert_to_numpy(optimizer.dynamic_scale)) == 2.0**15


def test_serialize_round_trip_without_custom_objects():
    optimizer = ALS(keras.optimizers.Adam(learning_rate=0.25), **CUSTOM)
    serialized = keras.saving.serialize_keras_object(optimizer)
    json.dumps(serialized)
    restored = keras.saving.deserialize_keras_object(copy.deepcopy(serialized))
    assert type(restored) is ALS
    assert restored.get_config() == optimizer.get_config()
    assert keras.saving.serialize_keras_object(restored) == serialized


# --------------------------------------------------------------------------
# Parity with the parent on an uninstrumented model
# --------------------------------------------------------------------------

STEPS = 6
BATCH = 8
# Steps whose gradient is not finite: one from an inf in the input batch,
# one from multiplying the scaled loss by inf.
INF_INPUT_STEP = 2
INF_LOSS_STEP = 4
INITIAL_SCALE = 2.0**8
GROWTH_STEPS = 2
# The parent's rule, by hand: a finite step increments the counter, or, when
# it reaches GROWTH_STEPS - 1, resets it and doubles S; a non-finite step
# resets it, halves S and skips the inner optimizer (no iteration).
#   step:        0    1    2    3    4    5
#   finite:      y    y    n    y    n    y
EXPECTED_SCALE = [256.0, 512.0, 256.0, 256.0, 128.0, 128.0]
EXPECTED_COUNTER = [1, 0, 0, 1, 0, 1]
EXPECTED_ITERATIONS = [1, 2, 2, 3, 3, 4]


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=[STEPS, BATCH, 5]).astype(np.float32)
    y = rng.normal(size=[STEPS, BATCH, 3]).astype(np.float32)
    x[INF_INPUT_STEP, 3, 1] = np.inf
    return x, y


def _models():
    """Two small mixed_float16 models with identical initial weights."""
    def build():
        return keras.Sequential(
            [
                keras.Input([5]),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(3),
            ]
        )

    a, b = build(), build()
    b.set_weights(a.get_weights())
    assert a.layers[0].compute_dtype == "float16"
    assert a.layers[0].kernel.dtype == "float32"
    return a, b


def _optimizers(inner_class, **inner_kwargs):
    kwargs = dict(initial_scale=INITIAL_SCALE, dynamic_growth_steps=GROWTH_STEPS)
    return (
        LSO(inner_class(**inner_kwargs), **kwargs),
        ALS(inner_class(**inner_kwargs), **kwargs),
    )


def _bits(model):
    return [np.asarray(w).tobytes() for w in model.get_weights()]


def _state(optimizer):
    return (
        float(optimizer.dynamic_scale.numpy()),
        int(optimizer.step_counter.numpy()),
        int(optimizer.iterations.numpy()),
    )


def _parent_variables(optimizer):
    """The variables Keras's LossScaleOptimizer also has, in its order
    (tf_als adds its skip counters, the loss flag and the record)."""
    extra = {
        id(optimizer.consecutive_skips),
        id(optimizer.loss_finite),
        id(optimizer.first_non_finite),
        id(optimizer.window_steps),
        id(optimizer.window_skips),
    }
    return [v for v in optimizer.variables if id(v) not in extra]


def _train_step(model, optimizer, x, y, poison):
    with tf.GradientTape() as tape:
        prediction = tf.cast(model(x, training=True), tf.float32)
        loss = tf.reduce_mean(tf.square(prediction - y))
        scaled = optimizer.scale_loss(loss)
        scaled = scaled * poison
    grads = tape.gradient(scaled, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)
    return grads


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_custom_loop_parity(mixed, mode):
    x, y = _data()
    model_a, model_b = _models()
    # SGD with momentum: its update is proportional to the gradient, so a
    # wrongly unscaled gradient shows (Adam's update is nearly invariant to
    # the gradient's scale).
    opt_a, opt_b = _optimizers(keras.optimizers.SGD, learning_rate=0.05, momentum=0.9)
    steps = {}
    for name, model, opt in (("keras", model_a, opt_a), ("tf_als", model_b, opt_b)):
        step = lambda x, y, p, model=model, opt=opt: _train_step(model, opt, x, y, p)  # noqa: E731
        steps[name] = tf.function(step) if mode == "tf_function" else step

    for i in range(STEPS):
        before = _bits(model_a)
        assert before == _bits(model_b), f"step {i}: weights differ before"
        poison = tf.constant(np.inf if i == INF_LOSS_STEP else 1.0, tf.float32)
        grads_a = steps["keras"](x[i], y[i], poison)
        grads_b = steps["tf_als"](x[i], y[i], poison)

        finite = all(bool(tf.reduce_all(tf.math.is_finite(g))) for g in grads_a)
        assert finite == (i not in (INF_INPUT_STEP, INF_LOSS_STEP)), i
        # Same scaled gradients reach both optimizers.
        for ga, gb in zip(grads_a, grads_b):
            assert np.asarray(ga).tobytes() == np.asarray(gb).tobytes(), i

        after = _bits(model_a)
        assert after == _bits(model_b), f"step {i}: weights differ"
        assert _state(opt_a) == _state(opt_b), i
        assert _state(opt_b) == (
            EXPECTED_SCALE[i],
            EXPECTED_COUNTER[i],
            EXPECTED_ITERATIONS[i],
        ), i
        if finite:
            assert after != before, f"step {i}: finite step did not train"
        else:
            assert after == before, f"step {i}: skipped step changed weights"
            previous = EXPECTED_SCALE[i - 1] if i else INITIAL_SCALE
            assert EXPECTED_SCALE[i] == previous / 2
    # Inner optimizer state (momentum) identical too.
    for va, vb in zip(opt_a.variables, _parent_variables(opt_b), strict=True):
        assert np.asarray(va).tobytes() == np.asarray(vb).tobytes(), va.path


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_fit_parity(mixed, jit_compile):
    x, y = _data()
    x, y = x.reshape([-1, 5]), y.reshape([-1, 3])
    model_a, model_b = _models()
    opt_a, opt_b = _optimizers(keras.optimizers.SGD, learning_rate=0.05, momentum=0.9)
    for model, opt in ((model_a, opt_a), (model_b, opt_b)):
        model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
        # Keras must not wrap either optimizer again.
        assert model.optimizer is opt
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert _bits(model_a) == _bits(model_b)
    # One non-finite batch (the inf input): 5 finite steps, 1 skipped.
    # S: 256 -> 512 (steps 0, 1) -> 256 (skip at 2) -> 256, 512 (3, 4) ->
    # 512 with counter 1 (5).
    assert _state(opt_a) == _state(opt_b) == (512.0, 1, 5)
    for va, vb in zip(opt_a.variables, _parent_variables(opt_b), strict=True):
        assert np.asarray(va).tobytes() == np.asarray(vb).tobytes(), va.path


def test_the_paper_rule_without_tensorflow_probability_names_the_install(monkeypatch):
    """tensorflow-probability is the `paper` extra, not a core dependency
    (its tf-keras would replace an older TensorFlow): the rule that needs
    it says what to install, when the optimizer is made, not at its first
    traced step."""
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "tensorflow_probability" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match=r"pip install 'tf_als\[paper\]'"):
        tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(), rule="paper")
    tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD())  # amax: no tfp
