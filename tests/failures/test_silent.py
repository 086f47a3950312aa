"""Silent float16 failures made visible: the forward headroom each point
records on telemetry steps, the near-maximum warning, and the zero-gradient
counter and warning (`silent`)."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tf_als._src.scaling import rule
from tf_als._src.failures import silent
from tf_als._src.training import state as state_module
from tests.modes import compiled

AMAX = state_module.RECORD_FIELDS.index("forward_amax")
NEAR_MAX = state_module.RECORD_FIELDS.index("forward_near_max_fraction")


def _model(bias=0.0, interval=1):
    """Input(8) -> Dense "big" (16 units, its bias `bias` on the even units,
    0 on the odd ones) -> Rescaling(2**-10) -> Dense "head" (4 outputs),
    instrumented and compiled with SGD and `telemetry_interval=interval`.
    "big" is a hidden layer whose float16 output may sit near float16's
    maximum while the loss sees nothing large (and no layer's weight
    gradient multiplies it: the rescaling has none)."""
    inputs = keras.Input((8,))
    big = keras.layers.Dense(16, name="big")(inputs)
    shrunk = keras.layers.Rescaling(2.0**-10)(big)
    outputs = keras.layers.Dense(4, name="head")(shrunk)
    base = keras.Model(inputs, outputs)
    base.get_layer("big").bias.assign(np.tile([bias, 0.0], 8))
    model = tf_als.instrument(base)
    optimizer = tf_als.AdaptiveLossScaleOptimizer(
        keras.optimizers.SGD(1e-3), telemetry_interval=interval
    )
    model.compile(optimizer=optimizer, loss=_small_loss)
    return model, optimizer


def _small_loss(y_true, y_pred):
    """Squared error times 2**-12 (in float32): keeps the gradients of an
    output near 8000 finite at the initial global scale."""
    error = tf.cast(y_pred, tf.float32) - tf.cast(y_true, tf.float32)
    return tf.reduce_mean(tf.square(error), axis=-1) * 2.0**-12


def _batch(seed=0, size=32):
    x = np.random.default_rng(seed).normal(size=(size, 8)).astype(np.float32)
    return x


def _references(model, x):
    """{point name: float16 output} of each point on `x`, computed apart
    from the instrumented model (the original layers, called eagerly)."""
    layers = {layer.name: layer for layer in model.uninstrumented().layers}
    big = layers["big"](x)
    head = layers["head"](layers["rescaling"](big))
    assert big.dtype == head.dtype == tf.float16
    return {"big": big.numpy(), "head": head.numpy()}


def _expected(output):
    """(amax, near-max share) of a float16 output, by numpy."""
    magnitude = np.abs(output.astype(np.float32))
    share = np.mean(magnitude >= 65504.0 / rule.NEAR_MAX_FACTOR)
    return float(magnitude.max()), float(share)


def _forward_records(model):
    records = keras.ops.convert_to_numpy(model.scaling_state.records)
    names = model.scaling_state.point_names
    return {n: (float(r[AMAX]), float(r[NEAR_MAX])) for n, r in zip(names, records)}


def _train_step(model, optimizer):
    """One training step on a batch `x` of 32 (target 0), in a custom loop."""
    target = tf.zeros([32, 4], tf.float32)

    def train(x):
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(
                tf.reduce_mean(_small_loss(target, model(x, training=True)))
            )
        variables = model.trainable_variables
        optimizer.apply(tape.gradient(loss, variables), variables)

    return train


@pytest.mark.parametrize(
    "mode", ["eager", "tf_function", pytest.param("xla", marks=pytest.mark.slow)]
)
def test_forward_headroom_is_recorded_on_telemetry_steps_only(mixed, mode):
    """Telemetry every 2 steps. At steps 0 and 2 each point's record holds
    the amax (exact) and near-maximum share (exact counts; float32
    division, rel 1e-6) of its float16 output, computed apart on the same
    batch and weights; step 1 (another batch, double the input) writes
    nothing: the records stay step 0's."""
    model, optimizer = _model(bias=5000.0, interval=2)
    step = compiled(_train_step(model, optimizer), mode)
    x = _batch()
    for factor, telemetry in ((1, True), (2, False), (3, True)):
        before = _forward_records(model)
        expected = {n: _expected(y) for n, y in _references(model, factor * x).items()}
        step(tf.constant(factor * x))
        recorded = _forward_records(model)
        assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == factor
        if not telemetry:
            assert recorded == before
            assert recorded != expected  # the batch was another one
            continue
        for name, (amax, share) in expected.items():
            assert recorded[name][0] == amax, (name, factor)
            assert recorded[name][1] == pytest.approx(share, rel=1e-6), (name, factor)
    # Half of big's units sit near 5000 (>= 4094), half near 0.
    assert recorded["big"][1] == pytest.approx(0.5, rel=1e-6)
    assert recorded["head"][1] == 0.0
    last = keras.ops.convert_to_numpy(model.scaling_state.last_updates)
    assert last.tolist() == [2, 2]


def _traced_step(jit_compile):
    """The graph of a training step of `_model` (two points), traced by a
    `tf.function` with `jit_compile`, and that function's library."""
    model, optimizer = _model(bias=5000.0, interval=2)
    train = tf.function(_train_step(model, optimizer), jit_compile=jit_compile)
    concrete = train.get_concrete_function(tf.TensorSpec([32, 8], tf.float32))
    library = concrete.graph.as_graph_def().library.function
    return concrete.graph, [f.signature.name for f in library]


@pytest.mark.parametrize(
    "jit_compile", [False, pytest.param(True, marks=pytest.mark.slow)]
)
def test_each_point_measures_its_forward_headroom_in_a_shared_branch(mixed, jit_compile):
    """Memory: in the traced training step each point's float16 output is
    read for its forward headroom by a branch of its own, which reads that
    output and nothing else, so it runs as soon as the point has run and
    keeps no activation alive longer than the layers after the point need
    it. One measurement over every point's outputs at the end of the
    forward pass held all of them until the last point ran (on a 4-layer
    GPT-2 of hidden size 256 with XLA, tf_als's peak fell from 2285 to
    2099 MiB with a measurement per point; Keras's is about 1400). Ops:
    the branches of points whose outputs have the same dtypes call the
    same two functions, so the step's library does not grow with
    the points (a `tf.cond` per point added two functions each)."""
    graph, library = _traced_step(jit_compile=jit_compile)
    branches = [
        op for op in graph.get_operations()
        if op.type == "StatelessIf" and "forward_headroom" in op.name
    ]
    read = [list(op.inputs[1:]) for op in branches]
    # Two points ("big" and "head"), one float16 output [32, units] each.
    assert [[x.dtype for x in r] for r in read] == [[tf.float16]] * 2, [
        op.name for op in branches
    ]
    assert read[0][0] is not read[1][0]
    functions = {
        op.get_attr(branch).name for op in branches
        for branch in ("then_branch", "else_branch")
    }
    assert len(functions) == 2 and functions <= set(library), (functions, library)


def _fit_collecting(model, x, y, batches=3):
    """Fits `model` on `batches` batches of 32 and calls
    `warn_silent_failures` after it; returns every `SilentFailureWarning`
    message issued (by fit itself, if the optimizer checks, or after)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(
            np.concatenate([x] * batches), np.concatenate([y] * batches),
            batch_size=len(x), epochs=1, verbose=0, shuffle=False,
        )
        returned = silent.warn_silent_failures(model)
    issued = [
        str(w.message) for w in caught if issubclass(w.category, silent.SilentFailureWarning)
    ]
    assert set(returned) <= set(issued)
    return issued


def test_near_max_warning_names_the_layer_and_the_fix(mixed):
    """A hidden Dense whose outputs sit near 8000 (bias 8000, within 16x of
    65504) while the loss sees small outputs: one warning, naming that
    layer (not the head) and the float32 fix, however often it is
    checked."""
    model, _ = _model(bias=8000.0)
    x = _batch()
    issued = _fit_collecting(model, x, np.zeros([32, 4], np.float32))
    assert len(issued) == 1, issued
    message = issued[0]
    assert "layer 'big' (Dense, scaling point 'big')" in message
    assert 'Give layer \'big\' dtype="float32"' in message
    assert "head" not in message
    amax = _forward_records(model)["big"][0]
    assert amax >= 65504.0 / rule.NEAR_MAX_FACTOR
    assert f"reached {amax:g}" in message
    assert silent.warn_silent_failures(model) == []  # once per point


def test_a_healthy_model_gets_no_warning(mixed):
    model, _ = _model(bias=0.0)
    x = _batch()
    assert _fit_collecting(model, x, np.zeros([32, 4], np.float32)) == []
    amaxes = [amax for amax, _ in _forward_records(model).values()]
    assert all(0.0 < a < 65504.0 / rule.NEAR_MAX_FACTOR for a in amaxes), amaxes


def _dice_model():
    """A float16 sigmoid head of 1024 outputs: over a batch of 256, the
    float16 sum of its outputs (about 131,000) is inf."""
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(1024, activation="sigmoid", name="head")(hidden)
    model = tf_als.instrument(keras.Model(inputs, outputs))
    optimizer = tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=optimizer)
    return model, optimizer


def _soft_dice(y_true, y_pred):
    """1 - 2 |y t| / (|y| + |t|), summed in the outputs' dtype: in float16
    the denominator overflows, so the loss is exactly 1 and its gradient
    exactly 0."""
    y_true = tf.cast(y_true, y_pred.dtype)
    overlap = tf.reduce_sum(y_pred * y_true)
    total = tf.reduce_sum(y_pred) + tf.reduce_sum(y_true)
    return tf.cast(1.0 - 2.0 * overlap / total, tf.float32)


def _squared(y_true, y_pred):
    return tf.reduce_mean(tf.square(tf.cast(y_pred, tf.float32) - y_true))


def test_zero_gradients_are_counted_and_warned_about_after_n_steps(mixed):
    """A custom loop whose soft-Dice loss sums float16 outputs into inf:
    the loss is exactly 1, every gradient exactly 0, nothing is skipped.
    The counter counts each step; the warning comes at step
    ZERO_GRADIENT_STEPS, not before, and once; a step with a real loss
    resets the counter."""
    model, optimizer = _dice_model()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(256, 16)).astype(np.float32))
    target = np.zeros([256, 1024], np.float32)
    target[0, :8] = 1.0

    @tf.function
    def step(loss_fn):
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(x, training=True))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss, tf.reduce_max([tf.reduce_max(tf.abs(g)) for g in grads])

    counter = model.scaling_state.zero_gradient_steps
    issued = []
    for n in range(1, silent.ZERO_GRADIENT_STEPS + 2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss, largest = step(_soft_dice)
            silent.warn_silent_failures(model)
        assert float(loss) == 1.0 and float(largest) == 0.0
        assert int(keras.ops.convert_to_numpy(counter)) == n
        issued.append(
            [str(w.message) for w in caught if w.category is silent.SilentFailureWarning]
        )
        expected = 1 if n == silent.ZERO_GRADIENT_STEPS else 0
        assert len(issued[-1]) == expected, (n, issued[-1])
    message = issued[silent.ZERO_GRADIENT_STEPS - 1][0]
    assert f"exactly zero for {silent.ZERO_GRADIENT_STEPS} steps" in message
    assert 'tf.cast(y_pred, "float32")' in message
    assert "float32_outputs=True" in message
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == n  # no skip
    _, largest = step(_squared)
    assert float(largest) > 0.0
    assert int(keras.ops.convert_to_numpy(counter)) == 0


def test_the_counter_resets_on_a_non_finite_step():
    """`count_zero_gradients` on crafted amaxes: zeros count, any nonzero
    or non-finite amax resets."""
    from tf_als._src.training import update

    state = state_module.ScalingState(["a", "b"])
    sequence = [
        ([0.0, 0.0], 1), ([0.0, 0.0], 2), ([0.0, float("inf")], 0),
        ([0.0, 0.0], 1), ([float("nan"), 0.0], 0), ([0.0, 0.0], 1),
    ]
    for amaxes, count in sequence:
        update.count_zero_gradients(state, tf.constant(amaxes))
        assert int(keras.ops.convert_to_numpy(state.zero_gradient_steps)) == count


def test_needs_an_instrumented_model():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(TypeError, match="tf_als.instrument"):
        silent.warn_silent_failures(model)
