"""The rule that runs is the rule that is tested.

A compiled training step of an instrumented model chooses every point's
scale through `rule.amax_of`, `rule.headroom` and `rule.scale_within` (the
limit as a bit pattern, `rule.bits_of`), the functions
tests/scaling/test_rule.py checks on crafted tensors, and the
scales it applies and writes are exactly what those functions give for
the amax and the inherited lift T_out each point measured in that step.
(`tests/test_structure.py` checks the same statically: every public
function of the rule is called from the library.)
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tf_als._src.scaling import rule
from tf_als._src.training import choice
from tf_als._src.training import compiled

RULE_FUNCTIONS = ("amax_of", "amax_reduction", "headroom", "scale_within")


def _model():
    """Four float16 Dense layers and a float32 head: five scaling points.
    With targets near 1e-3 and S = 1 the incoming gradients are small and
    differ from layer to layer, so the points lift, by different powers
    of two."""
    inputs = keras.Input((16,))
    x = inputs
    for i in range(4):
        x = keras.layers.Dense(32, activation="tanh", name=f"dense_{i}")(x)
    outputs = keras.layers.Dense(4, dtype="float32", name="head")(x)
    return keras.Model(inputs, outputs)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16)).astype("float32")
    y = (1e-3 * rng.normal(size=(32, 4))).astype("float32")
    return tf.constant(x), tf.constant(y)


def _spy(monkeypatch):
    """Counts the calls of the rule's per-step functions (while tracing:
    a `tf.function` calls Python once per trace)."""
    calls = {name: 0 for name in RULE_FUNCTIONS}
    for name in RULE_FUNCTIONS:
        original = getattr(rule, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(rule, name, counted)
    return calls


@pytest.mark.parametrize(
    "jit_compile, xla_runs",
    [(False, True), (False, False), (True, True)],
    ids=["graph", "graph-on-a-device-without-xla", "xla"],
)
def test_a_compiled_step_chooses_through_the_tested_rule(
    mixed, monkeypatch, jit_compile, xla_runs
):
    monkeypatch.setattr(compiled, "xla_runs", lambda: xla_runs)
    # The compiled choices are made once per process: made anew here,
    # their traces are this test's.
    choice.compiled_choice.cache_clear()
    calls = _spy(monkeypatch)
    model = tf_als.instrument(_model())
    optimizer = tf_als.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(1e-3), initial_scale=1.0
    )
    config = optimizer.scaling_config
    x, y = _data()
    variables = model.trainable_variables
    optimizer.build(variables)

    @tf.function(jit_compile=jit_compile)
    def step():
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(model(x, training=True) - y))
            scaled = optimizer.scale_loss(loss)
        optimizer.apply(tape.gradient(scaled, variables), variables)
        records = model.pass_record.latest()
        return [
            (records[p].scale, records[p].scale_out, records[p].amax)
            for p in sorted(records)
        ], tf.convert_to_tensor(model.scaling_state.backoff)

    chosen, backoff = step()
    points = len(model.scaling_points)
    assert len(chosen) == points == 5
    # Traced once. Under XLA, or where XLA does not run, every point read
    # its amax and chose through scale_within (amax_of also measures the
    # float16 outputs' forward headroom: more calls than points). Otherwise
    # every point read its gradient (`rule.amax_reduction`) and called one
    # compiled choice per gradient dtype, traced once each: the four
    # float16 Dense layers' and the float32 head's. The headroom was
    # computed once for the pass.
    compiled_step = xla_runs and not jit_compile
    traced = 2 if compiled_step else points
    assert calls["amax_reduction" if compiled_step else "amax_of"] >= points
    assert calls["scale_within"] == traced
    assert calls["headroom"] == 1

    # What the rule's functions give, eagerly, for what each point saw.
    limit = rule.headroom(config.overflow_margin, backoff)
    expected = [
        float(rule.scale_within(amax, limit, config.max_layer_scale, scale_out))
        for _, scale_out, amax in chosen
    ]
    applied = [float(scale) for scale, _, _ in chosen]
    assert applied == expected
    # The comparison is not vacuous: the points chose more than one scale,
    # and at least one is not the neutral 1.
    assert len(set(applied)) > 1 and any(s != 1.0 for s in applied), applied
    # The state holds what the step applied (the gradients were finite).
    assert bool(optimizer.check_finite(tape_free_gradients(variables)))
    written = model.scaling_state.scales.numpy().tolist()
    assert written == applied


def tape_free_gradients(variables):
    """Zero gradients of `variables`: `check_finite` of a finite list, to
    state the premise that the step above was applied, not skipped."""
    return [tf.zeros_like(v) for v in variables]


def test_the_probe_finds_whether_xla_runs(monkeypatch):
    # This machine's TensorFlow runs XLA on its CPU (the "graph" case above
    # relies on it).
    assert compiled._probe() is True

    def no_xla(function, **kwargs):
        def run(*args):
            raise tf.errors.UnimplementedError(None, None, "no XLA on this device")

        return run if kwargs.get("jit_compile") else function

    monkeypatch.setattr(tf, "function", no_xla)
    assert compiled._probe() is False


def test_one_compiled_choice_serves_every_shape_and_model(mixed, monkeypatch):
    # Its inputs are scalars, so XLA compiles it once per process, not once
    # per gradient shape (5 s for a DenseNet121's 70 shapes on a CPU): two
    # models of different widths, trained without XLA, trace the float16
    # choice once between them, and that trace is of scalars.
    monkeypatch.setattr(compiled, "xla_runs", lambda: True)
    choice.compiled_choice.cache_clear()
    x, y = _data()
    for width in (8, 24):
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(width, activation="tanh")(inputs)
        outputs = keras.layers.Dense(4, dtype="float32")(hidden)
        model = tf_als.instrument(keras.Model(inputs, outputs))
        optimizer = tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(1e-3))
        model.compile(optimizer, "mse", jit_compile=False)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    max_layer_scale = optimizer.scaling_config.max_layer_scale
    choose = choice.compiled_choice(tf.float16, max_layer_scale)
    assert choose.experimental_get_tracing_count() == 1
    # Asking for the scalar signature finds that trace: nothing new traced.
    choose.get_concrete_function(
        tf.TensorSpec([], tf.int16), tf.TensorSpec([], tf.int32),
        tf.TensorSpec([], tf.float32),
    )
    assert choose.experimental_get_tracing_count() == 1
