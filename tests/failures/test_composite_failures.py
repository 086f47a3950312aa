"""A composite layer whose own code fails in float16, between healthy
sublayers (`failure_cases.CausalSelfAttention`: GPT-2's attention masked
with 1e10, inf in float16). The search names the composite, not a
sublayer and not the data; promoting it switches its sublayers too, so
that it computes as float32 does, and that holds after save and load."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tf_als._src.failures import preflight
from tf_als._src.failures import promote
from tests import failure_cases

pytestmark = pytest.mark.usefixtures("mixed")

SUBLAYERS = ("c_attn", "c_proj")


def _batch(seed=0):
    batches, _ = failure_cases._characters(seed)
    x, y = batches[0]
    return x, y


def _loss(x, y, y_pred, sample_weight):
    return tf.reduce_mean(
        keras.losses.sparse_categorical_crossentropy(y, y_pred, from_logits=True)
    )


def _model(fix=False):
    keras.utils.set_random_seed(0)
    return failure_cases._gpt2_build(fix)


def test_the_model_fails_in_float16_only():
    """Guards the tests below: the float16 logits are NaN on the first
    batch; the same weights in float32, and the thread's fix (1e4) in
    float16, are finite."""
    x, _ = _batch()
    model = _model()
    assert np.isnan(np.asarray(model(x))).all()
    assert np.isfinite(np.asarray(_model(fix=True)(x))).all()
    with _float32():
        reference = _model()
    reference.set_weights(model.get_weights())
    assert np.isfinite(np.asarray(reference(x))).all()


def test_the_search_names_each_composite_and_no_sublayer():
    """Both attention layers are named, the second once the first computes
    in float32 (its input is NaN until then), each for its own code."""
    x, y = _batch()
    model = tf_als.instrument(_model())
    outcome = preflight.check(model, (x, y, None), _loss, scale=2.0**15, step=0)
    assert [p.layer for p in outcome.promotions] == ["attn_0", "attn_1"]
    assert all(p.reason == promote.COMPOSITE for p in outcome.promotions)
    assert outcome.stopped is None and outcome.scale is not None


def test_promoting_a_composite_switches_its_sublayers_and_matches_float32():
    """After the promotion, the attention layers and their Dense sublayers
    compute in float32, and the model's outputs agree with a float32 model
    of the same weights to float16's rounding elsewhere (2**-6 relative:
    the other layers still compute in float16)."""
    x, y = _batch()
    plain = _model()
    model = tf_als.instrument(plain)
    preflight.check(model, (x, y, None), _loss, scale=2.0**15, step=0)
    for i in range(2):
        attention = plain.get_layer(f"attn_{i}")
        assert attention.compute_dtype == "float32"
        for name in SUBLAYERS:
            assert getattr(attention, name).compute_dtype == "float32", (i, name)
    with _float32():
        reference = _model()
    reference.set_weights(plain.get_weights())
    got, want = np.asarray(model(x), "float32"), np.asarray(reference(x))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2.0**-6 * np.abs(want).max())


def test_undo_restores_every_sublayers_policy():
    x, y = _batch()
    plain = _model()
    model = tf_als.instrument(plain)
    attention = plain.get_layer("attn_0")
    before = [l.dtype_policy.name for l in promote.layers_of(attention)]
    previous = {}
    promote.promote_all(model, [preflight.Failure("attn_0", promote.COMPOSITE)], 0, previous)
    assert {l.dtype_policy.name for l in promote.layers_of(attention)} == {"float32"}
    promote.undo(model, "attn_0", previous["attn_0"])
    assert [l.dtype_policy.name for l in promote.layers_of(attention)] == before
    assert before == ["mixed_float16"] * 3


def test_fit_trains_past_it_and_a_reload_keeps_the_sublayers_in_float32(tmp_path):
    """`fit` promotes both at step 0, skips nothing, and a saved and
    reloaded model computes them, sublayers included, in float32 again
    (Keras rebuilds the sublayers from the composite's `__init__`, under
    the global policy)."""
    batches, _ = failure_cases._characters(0)
    x = np.concatenate([b[0] for b in batches[:8]])
    y = np.concatenate([b[1] for b in batches[:8]])
    model = tf_als.instrument(_model())
    optimizer = tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    with pytest.warns(UserWarning, match="promoted layer 'attn_0'"):
        history = model.fit(x, y, batch_size=8, verbose=0)
    assert int(optimizer.iterations.numpy()) == 8
    assert np.isfinite(history.history["loss"][-1])
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(
        path, custom_objects={"CausalSelfAttention": failure_cases.CausalSelfAttention}
    )
    attention = loaded.get_layer("attn_1")
    assert [l.compute_dtype for l in promote.layers_of(attention)] == ["float32"] * 3
    np.testing.assert_array_equal(np.asarray(loaded(x[:8])), np.asarray(model(x[:8])))


class _float32:
    """The global policy float32 within the block."""

    def __enter__(self):
        self.saved = keras.mixed_precision.global_policy()
        keras.mixed_precision.set_global_policy("float32")

    def __exit__(self, *exc):
        keras.mixed_precision.set_global_policy(self.saved)


def test_a_storm_that_promotes_nothing_does_not_blame_data_float32_runs(monkeypatch):
    """With the composite search taken away, the storm still stops the run,
    and its message says float32 runs the same batches cleanly: the data
    are fine. (test_storms' NaN data says the opposite.)"""
    monkeypatch.setattr(preflight, "_composite_failures", lambda forward: [])
    batches, _ = failure_cases._characters(0)
    x = np.concatenate([b[0] for b in batches[:6]])
    y = np.concatenate([b[1] for b in batches[:6]])
    model = tf_als.instrument(_model())
    optimizer = tf_als.AdaptiveLossScaleOptimizer(
        keras.optimizers.Adam(1e-3), max_consecutive_skips=4
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    with pytest.raises(tf_als.NonFiniteStormError) as caught:
        model.fit(x, y, batch_size=8, verbose=0)
    message = str(caught.value)
    assert "run in float32 with a finite loss and finite gradients" in message
    assert "the data are fine" in message
    assert tf_als.promoted(model) == []


def test_diagnose_gives_the_checks_answer_and_advice_that_reaches_sublayers():
    """`diagnose` names the layers the first-batch check promotes, in the
    same order, and says how to reach the sublayers in Keras 3."""
    x, y = _batch()
    plain = _model()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    report = tf_als.diagnose(plain, x, y, loss=loss, verbose=False)
    model = tf_als.instrument(_model())
    outcome = preflight.check(model, (x, y, None), _loss, scale=2.0**15, step=0)
    assert [layer for layer, _ in report.float16_failures] == [
        p.layer for p in outcome.promotions
    ]
    assert report.non_finite.startswith("Layer 'attn_0' fails in float16")
    assert "dtype=self.dtype_policy" in report.non_finite
    assert "'c_attn', 'c_proj'" in report.non_finite
    # diagnose changed no policy.
    assert {l.dtype_policy.name for l in promote.layers_of(plain.get_layer("attn_0"))} == {
        "mixed_float16"
    }


class AdvisedAttention(failure_cases.CausalSelfAttention):
    """The composite with `diagnose`'s advice applied as written: each
    sublayer made with `dtype=self.dtype_policy`."""

    def __init__(self, width, heads, mask_value, **kwargs):
        super().__init__(width, heads, mask_value, **kwargs)
        self.c_attn = keras.layers.Dense(3 * width, name="c_attn", dtype=self.dtype_policy)
        self.c_proj = keras.layers.Dense(width, name="c_proj", dtype=self.dtype_policy)


@pytest.mark.parametrize("advised", [False, True])
def test_the_advice_applied_as_written_trains_with_keras(monkeypatch, advised):
    """With the advice applied (sublayers made with the layer's policy, the
    layer given dtype='float32'), Keras's own LossScaleOptimizer trains to
    a finite loss; with dtype='float32' on the layer alone, as the old
    advice said, it still ends NaN."""
    if advised:
        monkeypatch.setattr(failure_cases, "CausalSelfAttention", AdvisedAttention)
    original = failure_cases.CausalSelfAttention.__init__

    def float32_attention(self, *args, **kwargs):
        original(self, *args, **dict(kwargs, dtype="float32"))

    monkeypatch.setattr(failure_cases.CausalSelfAttention, "__init__", float32_attention)
    model = _model()
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    batches, _ = failure_cases._characters(0)
    x = np.concatenate([b[0] for b in batches[:8]])
    y = np.concatenate([b[1] for b in batches[:8]])
    history = model.fit(x, y, batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"][-1]) == advised
