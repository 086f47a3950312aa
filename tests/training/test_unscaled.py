"""The division by the global scale S, folded into the backward pass's
per-call unscale where a variable's whole gradient is one call's product
(`unscaled`), and done as Keras does it everywhere else."""

import numpy as np
import pytest
import keras
import tensorflow as tf

import tf_als
from tf_als._src.training import unscaled

STEPS = 3
BATCH = 16


def _build(kind):
    """A small Functional model of `kind`, its weights drawn from seed 0:

    - "plain": two Dense layers, every gradient one call's product;
    - "regularized": an L2 kernel regularizer on the first Dense, whose
      term reaches that kernel's gradient from outside every scaling point;
    - "shared": one Dense called twice, its gradient a sum of two calls;
    - "embedding": an Embedding, whose gradient is sparse.
    """
    keras.utils.set_random_seed(0)
    if kind == "embedding":
        inputs = keras.Input([6], dtype="int32")
        h = keras.layers.Embedding(20, 8)(inputs)
        h = keras.layers.GlobalAveragePooling1D()(h)
    else:
        inputs = keras.Input([8])
        regularizer = keras.regularizers.L2(0.5) if kind == "regularized" else None
        dense = keras.layers.Dense(8, activation="tanh", kernel_regularizer=regularizer)
        h = dense(inputs)
        if kind == "shared":
            h = dense(h)
    outputs = keras.layers.Dense(3, dtype="float32")(h)
    return keras.Model(inputs, outputs)


def _data(kind):
    rng = np.random.default_rng(3)
    if kind == "embedding":
        x = rng.integers(0, 20, size=[STEPS * BATCH, 6]).astype("int32")
    else:
        x = rng.normal(size=[STEPS * BATCH, 8]).astype("float32")
    return x, rng.normal(size=[STEPS * BATCH, 3]).astype("float32")


def _fit(kind, policy, wrap, run_eagerly=False, jit_compile=False):
    """The change of every weight over `STEPS` steps of SGD with momentum
    (its update is proportional to the gradient, so a gradient divided by
    S once too often or too seldom shows)."""
    keras.mixed_precision.set_global_policy(policy)
    model = _build(kind)
    before = [np.array(w) for w in model.get_weights()]
    model, optimizer = wrap(model, keras.optimizers.SGD(0.1, momentum=0.9))
    model.compile(
        optimizer=optimizer, loss="mse", run_eagerly=run_eagerly, jit_compile=jit_compile
    )
    x, y = _data(kind)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return [np.array(w) - b for w, b in zip(model.get_weights(), before)]


def _plain(model, inner):
    return model, inner


def _keras(model, inner):
    return model, keras.optimizers.LossScaleOptimizer(inner)


def _tf_als(model, inner):
    # telemetry_interval=1: the per-layer scales chosen at step 0 serve at
    # steps 1 and 2, so the folded factors are not all 1/S.
    optimizer = tf_als.AdaptiveLossScaleOptimizer(inner, telemetry_interval=1)
    return tf_als.instrument(model), optimizer


# The weight changes of a float16 run differ from float32's by the rounding
# of float16 activations and gradients (unit roundoff 4.9e-4) through a few
# layers and three steps: within 2% of the largest change of each weight.
# Keras's own LossScaleOptimizer is held to the same bound, so the bound is
# what float16 arithmetic costs, not a loose one. A division by S
# (2**15) missing or doubled on any term is off by orders of magnitude.
TOLERANCE = 2e-2


def _far(changes, reference):
    return [
        i
        for i, (c, r) in enumerate(zip(changes, reference))
        if np.max(np.abs(c - r)) > TOLERANCE * np.max(np.abs(r))
    ]


MODES = {
    "graph": {},
    "xla": {"jit_compile": True},
    "eager": {"run_eagerly": True},
}


# With XLA in the slow suite, as every XLA variant whose graph variant runs
# by default.
@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(m, marks=[pytest.mark.slow] if m == "xla" else [])
        for m in sorted(MODES)
    ],
)
@pytest.mark.parametrize("kind", ["plain", "regularized", "shared", "embedding"])
def test_weight_changes_match_float32(kind, mode):
    reference = _fit(kind, "float32", _plain)
    assert all(np.max(np.abs(r)) > 0 for r in reference), "a weight did not train"
    assert _far(_fit(kind, "mixed_float16", _keras, **MODES[mode]), reference) == []
    assert _far(_fit(kind, "mixed_float16", _tf_als, **MODES[mode]), reference) == []


@pytest.fixture
def folds(monkeypatch):
    """Counts, per `apply`, the gradients divided in the backward pass's
    multiply ("folded") and those divided as Keras divides them."""
    counts = {"folded": 0, "divided": 0}
    divided = unscaled.UnscaledGradients.divided

    def counting(self, gradient, scale):
        result = divided(self, gradient, scale)
        counts["folded" if result is not None else "divided"] += 1
        return result

    monkeypatch.setattr(unscaled.UnscaledGradients, "divided", counting)
    return counts


@pytest.mark.parametrize(
    "kind, folded, divided",
    [
        ("plain", 4, 0),
        ("regularized", 3, 1),  # The regularized kernel; its bias folds.
        ("shared", 2, 2),  # The shared Dense's kernel and bias.
        ("embedding", 3, 0),  # The sparse embedding gradient folds too.
    ],
)
def test_which_gradients_fold(folds, kind, folded, divided):
    # A graph-mode fit traces its train step once, so `divided` runs once
    # per gradient, however many steps run.
    _fit(kind, "mixed_float16", _tf_als)
    assert folds == {"folded": folded, "divided": divided}


def test_eager_steps_divide_as_keras(folds):
    # Eagerly the product is already computed: nothing is recorded, and
    # every gradient is divided by S as Keras divides it.
    _fit("plain", "mixed_float16", _tf_als, run_eagerly=True)
    assert folds == {"folded": 0, "divided": 4 * STEPS}


def test_a_folded_gradient_is_the_divided_product():
    raw = tf.constant([3.0, -5.0, 2.0**-20], tf.float16)
    factor = tf.constant(2.0**-3)
    scale = tf.constant(2.0**15)
    ledger = unscaled.UnscaledGradients()

    @tf.function
    def fold():
        product = ledger.unscale(raw, factor)
        other = product * 1.0  # Not a recorded product.
        return ledger.divided(product, scale), ledger.divided(other, scale)

    folded, other = fold()
    assert other is None
    expected = (raw.numpy().astype(np.float32) * 2.0**-3) / 2.0**15
    np.testing.assert_array_equal(folded.numpy(), expected.astype(np.float16))


def test_traced_graph_is_the_graph_being_traced():
    assert unscaled.traced_graph() is None  # eager

    @tf.function
    def graph():
        found = unscaled.traced_graph()
        assert found is tf.constant(0.0).graph
        return tf.constant(0)

    graph()
