"""The first-batch check (`preflight`): each way a layer fails in
float16 is found, on small models built to fail that one way, healthy
layers are left alone, and the global scale chosen is the largest power of
two at which the batch's gradients are finite (checked against every power
of two in turn)."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tf_als._src.failures import backward_search
from tf_als._src.failures import preflight
from tf_als._src.failures import promote
from tests import failure_cases
from tests.failures import test_promote_backward

layers = keras.layers
pytestmark = pytest.mark.usefixtures("mixed")


def _mse(x, y, y_pred, sample_weight):
    return tf.reduce_mean(tf.square(tf.cast(y_pred, tf.float32) - y))


def _norms_model():
    """Two hand-written instance norms over 256x256 maps: one fed a positive
    map (its float16 sum and count are both inf: its mean is NaN), one a
    centred map (its sum is finite, its mean and variance read 0), and a
    healthy Dense between them."""
    inputs = keras.Input((256, 256, 1))
    x = failure_cases.HandInstanceNorm(name="positive")(inputs)
    x = layers.Dense(1, name="healthy")(x)
    x = failure_cases.HandInstanceNorm(name="centred")(x)
    return keras.Model(inputs, x)


def _positive_maps():
    """Two maps of mean 2: their sums, 131,072, overflow float16."""
    rng = np.random.default_rng(0)
    return (rng.normal(size=(2, 256, 256, 1)) + 2.0).astype("float32")


def test_forward_finds_each_norm_and_spares_the_dense():
    """The positive norm's NaN reaches everything after it, so the centred
    one is judged once the positive one computes in float32 (`check` loops
    until nothing fails)."""
    model = _norms_model()
    x = _positive_maps()
    findings = preflight.forward_failures(model, (x, None, None))
    assert findings == [preflight.Failure("positive", promote.FORWARD)]
    model.get_layer("positive").dtype_policy = keras.DTypePolicy("float32")
    (finding,) = preflight.forward_failures(model, (x, None, None))
    assert finding.layer == "centred" and finding.reason.startswith(promote.STRAYS)


def test_check_promotes_both_norms_and_nothing_else():
    model = tf_als.instrument(_norms_model())
    x = _positive_maps()
    outcome = preflight.check(model, (x, None, None), None, 2.0**15, step=0)
    assert {p.layer for p in outcome.promotions} == {"positive", "centred"}
    assert outcome.stopped is None
    assert model.uninstrumented().get_layer("healthy").compute_dtype == "float16"
    # Promoted, they match float32 within float16's rounding of the Dense
    # between them (the norms divide by a standard deviation of ~1).
    keras.mixed_precision.set_global_policy("float32")
    reference = _norms_model()
    reference.set_weights(model.uninstrumented().get_weights())
    np.testing.assert_allclose(
        np.asarray(model.uninstrumented()(x), "float32"), reference(x), rtol=0, atol=2e-2
    )
    assert preflight.forward_failures(model.uninstrumented(), (x, None, None)) == []


def test_targets_float16_cannot_hold_fail_their_output_layer():
    inputs = keras.Input((4,))
    outputs = layers.Dense(1, name="price")(layers.Dense(8, name="hidden")(inputs))
    model = keras.Model(inputs, outputs)
    x = np.ones((4, 4), "float32")
    big = np.full((4, 1), 2.0e5, "float32")
    (finding,) = preflight.forward_failures(model, (x, big, None))
    assert finding.layer == "price" and finding.reason.startswith(promote.TARGETS)
    # Half of float16's range is the line: 30,000 fits, 40,000 does not.
    assert preflight.forward_failures(model, (x, np.full((4, 1), 3e4, "float32"), None)) == []
    assert preflight.forward_failures(model, (x, np.full((4, 1), 4e4, "float32"), None))


def test_a_loss_summed_over_float16_outputs_fails_the_output_layer():
    """The soft-Dice of `failure_cases`: float16 outputs of four 256x256 maps
    sum past 65504; cast to float32 first they do not."""
    keras.utils.set_random_seed(0)
    model = failure_cases._segmenter(fix_norms=True, float32_head=False)
    batches, _ = failure_cases.SOFT_DICE.data(0)
    x, y = batches[0]

    def loss_fn(x, y, y_pred, sample_weight):
        return tf.cast(failure_cases.soft_dice(y, y_pred), tf.float32)

    (finding,) = preflight.forward_failures(model, (x, y, None), loss_fn=loss_fn)
    assert finding.layer == "mask" and finding.reason.startswith(promote.LOSS_DEPARTS)
    # Keras's own losses cast to float32: the same outputs pass.
    bce = lambda x, y, p, w: keras.losses.BinaryCrossentropy()(y, p)  # noqa: E731
    assert preflight.forward_failures(model, (x, y, None), loss_fn=bce) == []


def _largest_finite_scale(model, batch):
    """Every power of two from 2**15 down, one at a time."""
    for exponent in range(15, -25, -1):
        if backward_search.first_non_finite_gradient(model, _mse, batch, 2.0**exponent) is None:
            return 2.0**exponent
    return None


@pytest.mark.parametrize("target", [1.0, 3e2, 3e3, 2e4])
def test_the_scale_chosen_is_the_largest_finite_power_of_two(target):
    """A regression whose loss gradient grows with its target: the bisection
    agrees with trying every power of two."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = layers.Dense(16, activation="relu", name="hidden")(inputs)
    model = tf_als.instrument(
        keras.Model(inputs, layers.Dense(1, dtype="float32", name="out")(h))
    )
    rng = np.random.default_rng(0)
    batch = (
        rng.normal(size=(32, 8)).astype("float32"),
        np.full((32, 1), target, "float32"),
        None,
    )
    outcome = preflight.check(model, batch, _mse, 2.0**15, step=0)
    assert outcome.promotions == ()
    assert outcome.scale == _largest_finite_scale(model.uninstrumented(), batch)


class _HiddenGrowth(layers.Layer):
    """y = (x / 1024) * 1024, float16: the identity, whose backward pass
    multiplies the gradient by 1024 inside the layer and divides it back,
    so it overflows 1024 times below what its input and output gradients
    show."""

    def call(self, x):
        return (x / 1024.0) * 1024.0


def _summing_model(hidden_growth=False):
    """A Dense over 64 features, whose kernel gradient sums over the batch
    and so overflows before the gradients it receives and passes on."""
    inputs = keras.Input((64,))
    x = layers.Dense(64, name="wide")(inputs)
    if hidden_growth:
        x = _HiddenGrowth(name="growth")(x)
    return keras.Model(inputs, layers.Dense(1, dtype="float32", name="out")(x))


def _spied(forward):
    """`forward`, recording the scale of every backward pass it makes."""
    tried, backward = [], forward._backward

    def spy(scale):
        tried.append(scale)
        return backward(scale)

    forward._backward = spy
    return tried


@pytest.mark.parametrize("hidden_growth", [False, True])
def test_the_scale_search_agrees_with_every_power_of_two_in_fewer_passes(hidden_growth):
    """With an initial scale that overflows a weight gradient's sum, the
    search tries 2**15, 1 and the scale the gradients measured at 1 allow:
    three backward passes on one forward pass, with the answer of trying
    every power of two. When the overflow happens inside a layer, where
    nothing measured shows it, that guess fails and a bisection finds the
    same answer (at most 8 more passes: the exponents span 40)."""
    keras.utils.set_random_seed(0)
    model = _summing_model(hidden_growth)
    rng = np.random.default_rng(0)
    batch = (
        (rng.normal(size=(256, 64)) * 8).astype("float32"),
        np.full((256, 1), 100.0, "float32"),
        None,
    )
    expected = _largest_finite_scale(model, batch)
    assert expected is not None and 1.0 < expected < 2.0**15
    forward = backward_search.Forward(model, batch, _mse)
    tried = _spied(forward)
    assert preflight.largest_finite_scale(forward, 2.0**15) == expected
    if hidden_growth:
        assert 3 < len(tried) <= 3 + 8
    else:
        assert tried == [2.0**15, 1.0, expected]


def _weighted_cross_entropy(x, y, y_pred, sample_weight):
    """A cross-entropy on probabilities with a loss weight of 2**10: Keras
    clips the probabilities at 1e-7, which bounds the loss's gradient; the
    weight takes the failure below a scale of 2**-2."""
    return 2.0**10 * keras.losses.SparseCategoricalCrossentropy()(y, y_pred)


# Lowest failing exponents measured: -9, -8 and -4.
@pytest.mark.parametrize("sharpness", [32.0, 45.0, 55.0])
def test_the_output_search_agrees_with_every_power_of_two_in_four_passes(sharpness):
    """A float16 softmax under a cross-entropy on probabilities,
    sharpened so that the loss's gradient at the output, -1/p, fits
    float16 only below a scale of 1. `backward_failures` blames
    the layer that fails at the smallest power of two that is not finite,
    as trying every power from 2**-24 up finds; it tries 1, 2**-24, then
    the exponent the pass at 2**-24 measured and the next (four backward
    passes where a bisection made seven)."""
    model = test_promote_backward.sharp_softmax(sharpness)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    batch = (x, (x[:, 0] > 0).astype("int32") + 2 * (x[:, 1] > 0).astype("int32"), None)

    lowest = next(
        e for e in range(-24, 1)
        if backward_search.first_non_finite_gradient(model, _weighted_cross_entropy, batch, 2.0**e)
    )
    assert -24 < lowest < 0
    expected = backward_search.first_non_finite_gradient(
        model, _weighted_cross_entropy, batch, 2.0**lowest
    )
    forward = backward_search.Forward(model, batch, _weighted_cross_entropy)
    tried = _spied(forward)
    (failure,) = preflight.backward_failures(forward)
    assert expected.layer == failure.layer == "probs"
    assert tried == [1.0, 2.0**-24, 2.0 ** (lowest - 1), 2.0**lowest]


def test_fit_checks_the_first_batch_and_skips_nothing_for_it():
    """`dollars`' model, 2 epochs: promoted at step 0 and no step skipped at
    the scale chosen on the first batch for the first batches."""
    case = failure_cases.DOLLARS
    batches, _ = case.data(0)
    keras.utils.set_random_seed(0)
    model = tf_als.instrument(case.build(False))
    optimizer = tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer, case.loss)
    x, y = batches[0]
    with pytest.warns(UserWarning, match="promoted layer 'price' to float32 at step 0"):
        model.fit(x, y, batch_size=32, epochs=4, verbose=0)
    assert int(optimizer.iterations.numpy()) == 4
    expected = preflight.check(
        tf_als.instrument(_copy(model.uninstrumented())), (x, y, None), _mean_squared, 2.0**15, 0
    ).scale
    assert float(optimizer.dynamic_scale.numpy()) == expected


def _copy(model):
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    return clone


def _mean_squared(x, y, y_pred, sample_weight):
    return keras.losses.MeanSquaredError()(y, y_pred)


def test_float32_outputs_casts_exactly_and_round_trips(tmp_path):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    plain = keras.Model(inputs, layers.Dense(3, name="out")(inputs))
    model = tf_als.instrument(plain, float32_outputs=True)
    x = np.random.default_rng(0).normal(size=(2, 4)).astype("float32")
    out = model(x, training=True)
    assert out.dtype == tf.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain(x), "float32"))
    path = str(tmp_path / "model.keras")
    model.save(path)
    assert keras.models.load_model(path).float32_outputs is True
    with pytest.raises(ValueError, match="`float32_outputs` must be True or False; received 1"):
        tf_als.instrument(plain, float32_outputs=1)


def test_float16_outputs_warn_in_a_custom_loop_not_in_fit():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    plain = keras.Model(inputs, layers.Dense(3, name="out")(inputs))
    model = tf_als.instrument(plain)
    model.compile(tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD()), "mse")
    x, y = np.ones((4, 4), "float32"), np.zeros((4, 3), "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, epochs=1, verbose=0)
    assert not [w for w in caught if "float16 outputs" in str(w.message)]
    with pytest.warns(UserWarning, match="hands its training code float16 outputs \\('out'\\)"):
        model(x, training=True)


class _CastingStep(keras.Model):
    """keras.io's DDIM pattern: its own train_step computes the loss on a
    float32 cast of the float16 outputs."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(self(x, training=True), "float32") - y))
            scaled = self.optimizer.scale_loss(loss)
        self.optimizer.apply(tape.gradient(scaled, self.trainable_variables))
        return {"loss": loss}


def _float16_head(cls=keras.Model):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    return tf_als.instrument(cls(inputs, layers.Dense(3, name="out")(inputs), name="net"))


def _float16_warnings(caught):
    return [str(w.message) for w in caught if "float16 outputs" in str(w.message)]


def test_no_float16_outputs_warning_for_a_step_whose_loss_casts_first(mixed):
    """The DDIM's loss is computed on a float32 cast: no warning, in `fit`
    of its own train_step (traced) or in a compiled loop that casts."""
    model = _float16_head(_CastingStep)
    model.compile(tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD()))
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 3), "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert _float16_warnings(caught) == []


def test_the_float16_outputs_warning_fires_where_a_loss_squares_them(mixed):
    """A GAN-style compiled step calls the model without `training=True`
    and squares its float16 outputs before any cast: the warning names the
    model, its output and what the loss does, once; the same step with a
    cast first gives none."""

    def step_of(loss_of):
        model = _float16_head()
        optimizer = tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD())

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                scaled = optimizer.scale_loss(loss_of(model(x)))
            optimizer.apply(tape.gradient(scaled, model.trainable_variables),
                            model.trainable_variables)

        return step

    x = tf.ones((8, 4))
    found = []
    for loss_of in (
        lambda out: tf.reduce_mean(tf.square(out - 1.0)),
        lambda out: tf.reduce_mean(tf.square(tf.cast(out, "float32") - 1.0)),
    ):
        step = step_of(loss_of)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(x)
            step(x)
        found.append(_float16_warnings(caught))
    assert len(found[0]) == 1 and found[1] == [], found
    assert "Model 'net'" in found[0][0] and "('out')" in found[0][0]
    assert "which it sums or squares in float16" in found[0][0]


def _spectral_model():
    """A `SpectralNormalization` Dense, which in training mode assigns its
    own kernel (divided by its spectral norm) and power-iteration vector
    `vector_u` in `call`, then a plain Dense."""
    inputs = keras.Input((6,))
    x = layers.SpectralNormalization(layers.Dense(5), name="spectral")(inputs)
    return keras.Model(inputs, layers.Dense(1, name="out")(x))


def _spectral_step(variant, weights, x, y):
    """The spectral layer's `vector_u` and kernel after one `fit` step of
    `variant` from `weights`."""
    model = _spectral_model()
    model.set_weights(weights)
    if variant == "keras":
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    else:
        model = tf_als.instrument(model)
        optimizer = tf_als.AdaptiveLossScaleOptimizer(
            keras.optimizers.SGD(0.1), promote_on_storm=variant == "tf_als"
        )
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    spectral = model.get_layer("spectral")
    return np.array(spectral.vector_u), np.array(spectral.layer.kernel)


def test_the_check_leaves_every_variable_as_it_found_it():
    """The check runs the batch forward in training mode, where a
    `SpectralNormalization` layer assigns its kernel and `vector_u`. Both
    come out of the check bitwise as they went in, so the first step
    starts where Keras's does: `vector_u` after one step is Keras's
    exactly (it depends on the forward pass only), and the kernel is
    that of tf_als without the check (`promote_on_storm=False`), exactly
    (the same step from the same weights; Keras's own kernel differs from
    it by its gradient's float16 rounding under other scales)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    model = tf_als.instrument(_spectral_model())
    weights = model.get_weights()
    before = [np.array(v) for v in model.variables]
    outcome = preflight.check(model, (x, y, None), _mean_squared, 2.0**15, step=0)
    assert outcome.promotions == () and outcome.scale == 2.0**15
    for variable, value in zip(model.variables, before):
        np.testing.assert_array_equal(np.array(variable), value, err_msg=variable.path)

    keras_u, _ = _spectral_step("keras", weights, x, y)
    checked_u, checked_kernel = _spectral_step("tf_als", weights, x, y)
    unchecked_u, unchecked_kernel = _spectral_step("unchecked", weights, x, y)
    assert not np.array_equal(keras_u, np.array(model.get_layer("spectral").vector_u))
    np.testing.assert_array_equal(checked_u, keras_u)
    np.testing.assert_array_equal(checked_u, unchecked_u)
    np.testing.assert_array_equal(checked_kernel, unchecked_kernel)
