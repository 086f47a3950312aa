"""A failing layer whose float32 output the code that calls it cannot
take: GPT-2's 1e10 attention mask inside a KerasHub-style block
(`failure_cases.DecoderBlock`, whose `call` adds the attention's output
to its float16 residual with TensorFlow's `+`). The block is promoted as
a whole, as an expert gives the block `dtype="float32"`; in a Functional
model the attention alone is, since Keras's ops promote between layers
(test_composite_failures). Where only the model's own code could take the
output, the check says so and promotes nothing."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tf_als._src.failures import preflight
from tf_als._src.failures import promote
from tests import failure_cases
from tests.failures import test_reported_failures

pytestmark = pytest.mark.usefixtures("mixed")
layers = keras.layers


def _case(name):
    """(plain model, its float32 twin, the case's batches, loss_fn)."""
    model, reference, _, loss_fn = test_reported_failures._case(name)
    batches, _ = failure_cases.REPORTED[name].data(0)
    return model, reference, batches, loss_fn


def test_the_attention_alone_in_float32_breaks_the_block():
    """Guards the tests below: the attention's float32 output meets the
    block's float16 residual in TensorFlow's `+`."""
    model, _, batches, _ = _case("gpt2_mask_block")
    attention = model.get_layer("block_0").attn
    for layer in promote.layers_of(attention):  # Its sublayers too.
        layer.dtype_policy = keras.DTypePolicy("float32")
    with pytest.raises(tf.errors.InvalidArgumentError, match="half"):
        model(batches[0][0])


@pytest.mark.parametrize(
    "name, prefix", [("gpt2_mask_block", ""), ("gpt2_mask_subclassed", "character_gpt/")]
)
def test_the_block_is_promoted_whole_and_matches_float32(name, prefix):
    """Both blocks are promoted, each for its attention, every layer inside
    them computes in float32, and the outputs agree with the float32
    twin's to 2**-6 of their largest magnitude (the embeddings and the
    final norm still compute in float16)."""
    plain, reference, batches, loss_fn = _case(name)
    model = tf_als.instrument(plain)
    x, y = batches[0]
    outcome = preflight.check(model, (x, y, None), loss_fn, scale=2.0**15, step=0)
    assert [p.layer for p in outcome.promotions] == [f"{prefix}block_0", f"{prefix}block_1"]
    assert f"in '{prefix}block_0/attn'" in outcome.promotions[0].reason
    assert outcome.stopped is None
    for i in range(2):
        block = promote.layer_at(plain, f"{prefix}block_{i}")
        assert {l.compute_dtype for l in promote.layers_of(block)} == {"float32"}
    got, want = np.asarray(model(x), "float32"), np.asarray(reference(x))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2.0**-6 * np.abs(want).max())


def test_fit_promotes_the_blocks_at_step_zero_and_diagnose_agrees():
    plain, _, batches, loss_fn = _case("gpt2_mask_block")
    x = np.concatenate([b[0] for b in batches[:6]])
    y = np.concatenate([b[1] for b in batches[:6]])
    loss = failure_cases.REPORTED["gpt2_mask_block"].loss
    report = tf_als.diagnose(plain, x[:8], y[:8], loss=loss, verbose=False)
    model = tf_als.instrument(plain)
    optimizer = tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(3e-3))
    model.compile(optimizer=optimizer, loss=loss)
    with pytest.warns(UserWarning, match="promoted layer 'block_0'"):
        history = model.fit(x, y, batch_size=8, verbose=0)
    promoted = [(p.layer, p.step) for p in tf_als.promoted(model)]
    assert promoted == [("block_0", 0), ("block_1", 0)]
    assert [layer for layer, _ in report.float16_failures] == ["block_0", "block_1"]
    assert int(optimizer.iterations.numpy()) == 6
    assert np.isfinite(history.history["loss"][-1])


class _MaskedInCall(keras.Model):
    """A subclassed model whose own `call` adds the attention's output to
    its float16 residual: only the model could take it in float32."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.wte = layers.Embedding(16, 32, name="wte")
        self.attn = failure_cases.CausalSelfAttention(32, 2, 1e10, name="attn")
        self.head = layers.Dense(16, dtype="float32", name="head")

    def call(self, tokens):
        x = self.wte(tokens)
        return self.head(x + self.attn(x))


def test_a_failure_only_the_model_could_take_is_left_with_the_reason():
    keras.utils.set_random_seed(0)
    plain = _MaskedInCall()
    batches, _ = failure_cases._characters(0)
    x, y = batches[0]
    plain(x)
    model = tf_als.instrument(plain)
    loss_fn = preflight.batch_mean_loss(
        keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    outcome = preflight.check(model, (x, y, None), loss_fn, scale=2.0**15, step=0)
    assert outcome.promotions == ()
    assert "cannot be promoted alone" in outcome.stopped
    assert "_masked_in_call/attn'" in outcome.stopped
    assert {l.compute_dtype for l in promote.layers_of(plain.attn)} == {"float16"}


class _AdvisedAttention(failure_cases.CausalSelfAttention):
    """The attention as the advice has it written: its `__init__` with
    each sublayer made with dtype=self.dtype_policy (the code is the
    case's, `call` and all)."""

    def __init__(self, width, heads, mask_value, **kwargs):
        layers.Layer.__init__(self, **kwargs)
        self.width, self.heads, self.mask_value = width, heads, mask_value
        self.c_attn = layers.Dense(3 * width, name="c_attn", dtype=self.dtype_policy)
        self.c_proj = layers.Dense(width, name="c_proj", dtype=self.dtype_policy)


class _AdvisedBlock(failure_cases.DecoderBlock):
    """The block with `diagnose`'s advice applied as written: every
    sublayer made with dtype=self.dtype_policy, inside the attention too."""

    def __init__(self, width, mask_value, **kwargs):
        layers.Layer.__init__(self, **kwargs)
        self.width, self.mask_value = width, mask_value
        policy = self.dtype_policy
        self.ln_1 = layers.LayerNormalization(name="ln_1", dtype=policy)
        self.attn = _AdvisedAttention(width, 2, mask_value, name="attn", dtype=policy)
        self.ln_2 = layers.LayerNormalization(name="ln_2", dtype=policy)
        self.c_fc = layers.Dense(2 * width, activation="gelu", name="c_fc", dtype=policy)
        self.mlp_proj = layers.Dense(width, name="mlp_proj", dtype=policy)


def test_the_advice_for_the_block_reaches_inside_its_attention_and_works():
    """The advice names the block's sublayers and says the attention has
    sublayers of its own; applied as written (the blocks given
    dtype='float32'), the float16 model agrees with float32's."""
    plain, reference, batches, _ = _case("gpt2_mask_block")
    x, y = batches[0]
    loss = failure_cases.REPORTED["gpt2_mask_block"].loss
    report = tf_als.diagnose(plain, x, y, loss=loss, verbose=False)
    advice = report.failure_advice[0]
    assert "dtype=self.dtype_policy in its __init__ (and so inside 'attn', which has" in advice
    assert "give 'block_0' dtype='float32'" in advice
    keras.utils.set_random_seed(0)  # The case's seed: its position table
    tokens = keras.Input((24,), dtype="int32")  # is a constant, not a weight.
    h = layers.Embedding(16, 32, name="wte")(tokens)
    h = h + layers.Embedding(24, 32, name="wpe")(keras.ops.arange(24))
    for i in range(2):
        h = _AdvisedBlock(32, 1e10, name=f"block_{i}", dtype="float32")(h)
    h = layers.LayerNormalization(name="ln_f")(h)
    advised = keras.Model(tokens, layers.Dense(16, dtype="float32", name="lm_head")(h))
    advised.set_weights(plain.get_weights())
    assert {l.compute_dtype for l in promote.layers_of(advised.get_layer("block_0"))} == {
        "float32"
    }
    got, want = np.asarray(advised(x), "float32"), np.asarray(reference(x))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2.0**-6 * np.abs(want).max())
