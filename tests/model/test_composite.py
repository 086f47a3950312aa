"""Scaling points inside composite layers: `MultiHeadAttention`, a custom
composite layer, a subclassed model used as a layer, and KerasHub
backbones (built from constructor arguments; nothing downloads).

The gradient oracle (`tests/test_oracle.py`) runs the same models against
float32; here: where the points are, that the forward pass is untouched,
that every inner point is measured in `fit` with XLA on and off, what stays
closed and why, and that a saved model resumes exactly.
"""

import collections
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tests import architectures

COMPOSITE_CASES = [
    c for c in architectures.ALL_CASES
    if c.name in ("transformer", "composite_layers", "subclassed")
    or c in architectures.HUB_CASES
]


def _case_params(slow=(), cases=COMPOSITE_CASES):
    for case in cases:
        marks = [pytest.mark.slow] if case.name in slow else []
        yield pytest.param(case, id=case.name, marks=marks)


def _trainable(case, **compile_kwargs):
    """The case's mixed model, instrumented and compiled with scale updates
    on every step, and its batch."""
    _, model = case.build_pair()
    x, y = case.data()
    instrumented = tf_als.instrument(model)
    instrumented.compile(
        optimizer=tf_als.AdaptiveLossScaleOptimizer(
            keras.optimizers.Adam(1e-3), telemetry_interval=1
        ),
        loss=case.loss,
        **compile_kwargs,
    )
    return instrumented, x, y


def _leaf_calls(model, x):
    """Counts, independently of tf_als, the calls of layers that own
    variables directly (Keras's own per-layer variable lists) in one
    forward pass of the original model: `{id(layer): calls}`."""
    counts = collections.Counter()
    original = keras.layers.Layer.__call__

    def counting(layer, *args, **kwargs):
        if layer._trainable_variables or layer._non_trainable_variables:
            counts[id(layer)] += 1
        return original(layer, *args, **kwargs)

    keras.layers.Layer.__call__ = counting
    try:
        model(x, training=True)
    finally:
        keras.layers.Layer.__call__ = original
    return counts


@pytest.mark.parametrize("case", list(_case_params()))
def test_a_point_at_every_weight_owning_layer_call(mixed, case):
    _, model = case.build_pair()
    x, _ = case.data()
    calls = _leaf_calls(model, x)
    instrumented = tf_als.instrument(model)
    infos = tf_als.points(instrumented)
    layers = tuple(p.layer for p in instrumented.point_records)
    leaf_points = [
        layer for info, layer in zip(infos, layers) if info.kind == "layer"
    ]
    assert not [info for info in infos if info.kind == "closed"]
    assert len(leaf_points) == sum(calls.values())
    assert collections.Counter(id(layer) for layer in leaf_points) == calls
    names = list(tf_als.scales(instrumented))
    assert len(names) == len(set(names)) == len(infos)


@pytest.mark.parametrize("case", list(_case_params()))
@pytest.mark.parametrize("training", [True, False])
def test_forward_outputs_are_bitwise_equal(mixed, case, training):
    _, model = case.build_pair()
    x, _ = case.data()
    expected = keras.ops.convert_to_numpy(model(x, training=training))
    instrumented = tf_als.instrument(model)
    with tf.GradientTape():  # recorded: the scaling points run
        got = keras.ops.convert_to_numpy(instrumented(x, training=training))
    np.testing.assert_array_equal(got, expected)


# With XLA (about twice as long to compile), one case per kind of inner
# point: attention with a tied embedding called twice (GPT-2), convolutions
# in a KerasHub backbone (ResNet), and a user's own composite layers. Every
# case runs without XLA. An inner point is the same hooked call and custom
# gradient in every backbone, so the other backbones (BERT, Llama, Gemma,
# ViT, the subclassed and transformer cases) add XLA compile time (~30 s
# of CPU each) but no new kind of point.
XLA_CASES = ("gpt2", "resnet_backbone", "composite_layers")


def _fit_params():
    """Every case without XLA, in the default suite but for the heavy
    KerasHub backbones; `XLA_CASES` with XLA, in the slow suite."""
    heavy = ("llama", "gemma", "bert", "resnet_backbone", "vit")
    for jit_compile, mode in ((False, "graph"), (True, "xla")):
        for case in COMPOSITE_CASES:
            if jit_compile and case.name not in XLA_CASES:
                continue
            slow = jit_compile or case.name in heavy
            yield pytest.param(
                case, jit_compile, id=f"{mode}-{case.name}",
                marks=[pytest.mark.slow] if slow else [],
            )


@pytest.mark.parametrize("case, jit_compile", list(_fit_params()))
def test_fit_measures_every_inner_point(mixed, case, jit_compile):
    """Two `fit` steps with scale updates on every step: the loss stays
    finite, and every point, inner ones included, recorded an update (its
    `last_update` starts at -1) and holds a power-of-two scale."""
    instrumented, x, y = _trainable(case, jit_compile=jit_compile)
    history = instrumented.fit(x, y, epochs=2, batch_size=len(y), verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    for point in instrumented.scaling_points:
        state = point.read()
        assert state["last_update"] >= 0, point.point_name
        assert np.log2(state["scale"]) == int(np.log2(state["scale"]))


@pytest.mark.parametrize(
    "case",
    list(
        _case_params(
            # The composite layers stay in the default suite.
            slow=(
                "llama_classifier", "bert", "resnet_backbone", "vit",
                "subclassed", "transformer", "gpt2_classifier",
            ),
            cases=architectures.SAVE_CASES,
        )
    ),
)
def test_save_load_and_resume_is_bitwise_equal(mixed, case, tmp_path):
    instrumented, x, y = _trainable(case)
    instrumented.fit(x, y, epochs=2, batch_size=len(y), verbose=0)
    path = os.path.join(tmp_path, "model.keras")
    instrumented.save(path)
    restored = keras.models.load_model(path)
    # Positions, not names: layers named automatically (`dense_7`) get new
    # names when the same process builds them again.
    scales = lambda m: list(tf_als.scales(m).values())  # noqa: E731
    assert scales(restored) == scales(instrumented)
    for model_ in (instrumented, restored):
        model_.fit(x, y, epochs=1, batch_size=len(y), verbose=0)
    assert scales(restored) == scales(instrumented)
    for a, b in zip(instrumented.weights, restored.weights):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)
        )


def test_names_are_layer_paths(mixed):
    _, model = architectures.COMPOSITE_NAMES_CASE.build_pair()
    names = list(tf_als.scales(tf_als.instrument(model)))
    backbone = names[0].split("/")[0]  # gpt2_backbone, numbered if rebuilt
    assert backbone.startswith("gpt2_backbone")
    assert f"{backbone}/transformer_layer_0" in names
    assert f"{backbone}/transformer_layer_0/self_attention/query" in names
    assert f"{backbone}/transformer_layer_1/feedforward_output_dense" in names
    # The embedding, called in the backbone and again (reversed) by the
    # task's head, outside the backbone: both calls carry its full path.
    assert f"{backbone}/token_embedding/call_0" in names
    assert f"{backbone}/token_embedding/call_1" in names
    assert all(name.startswith(f"{backbone}/") for name in names), names


class _Recurrent(keras.layers.Layer):
    """A composite holding an LSTM (closed: its cell runs in a loop)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.project = keras.layers.Dense(8, name="project")
        self.lstm = keras.layers.LSTM(8, name="lstm")

    def call(self, x):
        return self.lstm(self.project(x))


def test_a_layer_that_cannot_be_opened_stays_one_point_and_is_named(mixed):
    inputs = keras.Input((5, 4))
    x = _Recurrent(name="recurrent")(inputs)
    outputs = keras.layers.Dense(2, dtype="float32", name="head")(x)
    model = keras.Model(inputs, outputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        instrumented = tf_als.instrument(model)
    messages = [str(w.message) for w in caught if "tf_als.instrument" in str(w.message)]
    assert len(messages) == 1
    assert "'recurrent/lstm' (LSTM)" in messages[0]
    assert "inside a loop" in messages[0]
    infos = {info.name: info for info in tf_als.points(instrumented)}
    assert set(infos) == {"recurrent", "recurrent/project", "recurrent/lstm", "head"}
    assert infos["recurrent"].kind == "composite"
    assert infos["recurrent/project"].kind == "layer"
    assert infos["recurrent/lstm"].kind == "closed"
    assert "tf.while_loop" in infos["recurrent/lstm"].reason
    assert infos["head"].reason is None


def test_points_needs_an_instrumented_model(mixed):
    with pytest.raises(TypeError, match=r"tf_als.points\(\) needs a model"):
        tf_als.points(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))


def test_underflow_inside_attention_is_rescued(mixed):
    """BERT-tiny with its loss scaled by 2**-16 (a small auxiliary loss):
    Keras's global scale flushes to zero at least 3% of the query and key
    kernel-gradient elements that are nonzero in float32 (measured 6.6% to
    11.7%); with the attention projections as points of their own, tf_als
    flushes at most 0.1% and keeps the direction (cosine >= 0.999; measured
    0% and 1.0000). Both are compared with float32 gradients of the same
    weights on the same batch. `tf_als.diagnose` flags the four projections
    under Keras's scaling (more than 1% of a row's kernel and bias
    elements flushed) and no layer under tf_als (none above 0.1%)."""
    from tests import gradients

    case = next(c for c in architectures.HUB_CASES if c.name == "bert")
    reference, model = case.build_pair()
    x, y = case.data()

    def loss(y_true, y_pred):
        return case.loss(y_true, y_pred) * 2.0**-16

    expected = gradients.float32_gradients(reference, x, y, loss)
    keras_grads, _ = gradients.applied_gradients(
        model,
        keras.optimizers.LossScaleOptimizer(gradients.GradientRecorder()),
        x, y, loss,
    )
    als_grads, _ = gradients.applied_gradients(
        tf_als.instrument(model),
        tf_als.AdaptiveLossScaleOptimizer(gradients.GradientRecorder()),
        x, y, loss,
    )
    checked = 0
    for variable, kept, ours, truth in zip(
        model.trainable_variables, keras_grads, als_grads, expected
    ):
        if not variable.path.endswith(("query/kernel", "key/kernel")):
            continue
        checked += 1
        lost = lambda g: np.mean((g == 0) & (truth != 0))  # noqa: E731
        assert lost(kept) >= 0.03, variable.path
        assert lost(ours) <= 0.001, variable.path
        assert gradients.compare(ours, truth)["cosine"] >= 0.999, variable.path
    assert checked == 4

    # diagnose sees the same, one row per projection.
    report = tf_als.diagnose(model, x, y, loss=loss, verbose=False)
    projections = {
        r.point for r in report.rows if r.point.endswith(("/query", "/key"))
    }
    assert len(projections) == 4, [r.point for r in report.rows]
    assert projections <= set(report.underflowing(0.01)), str(report)
    assert report.underflowing(0.001, scaling="tf_als") == [], str(report)
