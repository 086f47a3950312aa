"""`tf_als.diagnose`: per-layer underflow and error of Keras's loss scaling
and of tf_als against float32, and where gradients turn non-finite."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits

import tf_als
from tf_als._src.failures import forward_search
from tf_als._src.monitoring import diagnosis
from tf_als._src.model import composite
from tf_als._src.model import graph
from tf_als._src.model import _keras
from tests import architectures
from tests import gradients
from tests.training import test_underflow

layers = keras.layers


def _case(name):
    return next(c for c in architectures.ALL_CASES if c.name == name)


def _check_row(report, layer, model, reference, x, y, loss, training=True):
    """`layer`'s row against an independent computation: float32 gradients
    of `reference` (a float32 build with the same weights) and float16
    gradients of `model` scaled by the report's Keras scale.

    Tolerance: diagnose's float32 reference runs `model`'s own layers under
    a float32 policy; on this CPU some float32 kernels take other paths in
    the two builds (Keras runs some convolutions through XLA) and differ by
    up to ~1e-3 relative. By the triangle inequality the relative errors
    then differ by at most d = |g32_a - g32_b| / |g32_a|, which the test
    measures and allows (plus 1e-7). The flushed fraction must match
    exactly."""
    row = next(r for r in report.rows if r.layer == layer.name)
    mine = {id(w) for w in layer.trainable_weights}
    positions = [i for i, v in enumerate(model.trainable_variables) if id(v) in mine]
    assert positions

    def gradients_of(network, scale):
        # Only `layer`'s variables: the graph keeps the backward pass they
        # need and drops the rest (on ConvNeXtTiny, most of the trace and of
        # the float16 convolution gradients, which have no fast CPU kernel).
        variables = [network.trainable_variables[i] for i in positions]

        @tf.function
        def compute(x, y):
            with tf.GradientTape() as tape:
                value = tf.cast(loss(y, network(x, training=training)), tf.float32)
                value = value * scale
            return tape.gradient(value, variables)

        grads = compute(x, y)
        return np.concatenate(
            [
                np.ravel(np.asarray(g, np.float64)) / scale
                for g in grads
                if g is not None  # (listed in `no_gradient`)
            ]
        )

    truth = gradients_of(reference, 1.0)
    kept = gradients_of(model, report.keras_loss_scale)
    with _keras.dtype_policy(_keras.all_layers(model), "float32"):
        swapped = gradients_of(model, 1.0)
    norm = np.linalg.norm(truth)
    drift = np.linalg.norm(swapped - truth) / norm
    assert drift < 1e-2, drift  # the two float32 references agree
    error = np.linalg.norm(kept - truth) / norm
    resolved = np.abs(truth) > 2.0**-23 * np.abs(truth).max()
    assert abs(row.keras_error - error) <= drift + 1e-7, (row, error, drift)
    assert row.keras_underflow == np.mean((kept == 0) & resolved), row


def _digits_batch():
    digits = load_digits()
    x = (digits.data[:64] / 16.0).astype("float32")
    return x, digits.target[:64]


def test_flags_exactly_the_layers_that_underflow(mixed, capsys):
    """The 16-layer sigmoid MLP of test_underflow at initialisation: the
    report's Keras underflow per layer equals what the inner optimizer of a
    real LossScaleOptimizer receives (computed independently here), the
    flagged layers are those above 1%, and tf_als leaves none."""
    model = test_underflow._build()
    x, y = _digits_batch()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    report = tf_als.diagnose(model, x, y, loss=loss)
    assert "tf_als precision report" in capsys.readouterr().out

    keras.mixed_precision.set_global_policy("float32")
    reference = test_underflow._build()
    reference.set_weights(model.get_weights())
    expected = gradients.float32_gradients(reference, x, y, loss)
    keras.mixed_precision.set_global_policy("mixed_float16")
    optimizer = keras.optimizers.LossScaleOptimizer(gradients.GradientRecorder())
    received, _ = gradients.applied_gradients(model, optimizer, x, y, loss)
    assert report.keras_loss_scale == float(optimizer.dynamic_scale)

    flagged = []
    for row, layer in zip(report.rows, [l for l in model.layers if l.weights]):
        assert row.layer == layer.name
        i = [v.path for v in model.trainable_variables].index(layer.kernel.path)
        got = np.concatenate([received[i].ravel(), received[i + 1].ravel()])
        truth = np.concatenate([expected[i].ravel(), expected[i + 1].ravel()])
        flushed = float(np.mean((got == 0) & (truth != 0)))
        assert row.keras_underflow == pytest.approx(flushed, abs=1e-12)
        if flushed > 0.01:
            flagged.append(row.point)
        assert row.als_underflow <= 0.01
    assert flagged and report.underflowing(0.01) == flagged
    assert report.non_finite is None


def test_names_the_layer_whose_gradient_overflows(mixed):
    """`shrink` makes tiny activations and `boom` (kernel x 2000) brings
    them back, so the forward pass is tame; backwards, boom multiplies the
    gradient by its large kernel, and at the starting scale 2**15 its input
    gradient overflows float16 while its incoming gradient and its own
    weight gradient stay finite."""
    inputs = keras.Input((16,))
    x = layers.Dense(32, activation="tanh", name="first")(inputs)
    x = layers.Dense(32, name="shrink")(x)
    x = layers.Dense(32, activation="tanh", name="boom")(x)
    outputs = layers.Dense(4, dtype="float32", name="head")(x)
    model = keras.Model(inputs, outputs)
    shrink, boom = model.get_layer("shrink"), model.get_layer("boom")
    shrink.kernel.assign(shrink.kernel * 1e-3)
    boom.kernel.assign(boom.kernel * 2000.0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16)).astype("float32")
    y = rng.integers(0, 4, size=(32,))
    assert np.all(np.isfinite(np.asarray(model(x))))
    report = tf_als.diagnose(
        model,
        x,
        y,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        verbose=False,
    )
    assert report.non_finite is not None
    assert report.non_finite.startswith("Gradients turn non-finite in layer 'boom'")
    assert "but its input gradient is not." in report.non_finite
    assert report.keras_loss_scale < 2.0**15  # Keras backed off to fit.
    assert "Gradients turn non-finite in layer 'boom'" in str(report)


def test_names_the_loss_when_labels_are_not_finite(mixed):
    model = test_underflow._build()
    x, _ = _digits_batch()
    y = np.full((64, 10), np.nan, "float32")
    report = tf_als.diagnose(
        model, x, y, loss=keras.losses.CategoricalCrossentropy(from_logits=True),
        verbose=False,
    )
    assert report.non_finite.startswith("The loss is not finite in float32 either")
    # No scale makes a NaN loss finite: none is reported as working.
    assert report.keras_loss_scale is None and report.als_loss_scale is None
    assert "none (not finite at any scale" in str(report)


def test_works_on_an_instrumented_model_without_changing_it(mixed):
    model = tf_als.instrument(test_underflow._build())
    for point in model.scaling_points:
        point.scale.assign(4.0)
    x, y = _digits_batch()
    model.compile(
        optimizer=tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.SGD()),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    report = tf_als.diagnose(model, x, y, verbose=False)  # the compiled loss
    assert len(report.rows) == len(model.scaling_points)
    assert set(tf_als.scales(model).values()) == {4.0}


def test_a_loss_given_by_name_is_reduced_as_compile_reduces_it(mixed):
    """`loss="sparse_categorical_crossentropy"` is Keras's per-sample
    function; the report must equal the one for the Loss object, whose
    default reduction is the mean over the batch."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    hidden = layers.Dense(16, activation="relu")(inputs)
    model = keras.Model(inputs, layers.Dense(10, activation="softmax", dtype="float32")(hidden))
    x, y = _digits_batch()
    x = np.reshape(x, (len(x), -1))
    by_name = tf_als.diagnose(model, x, y, loss="sparse_categorical_crossentropy", verbose=False)
    by_object = tf_als.diagnose(
        model, x, y, loss=keras.losses.SparseCategoricalCrossentropy(), verbose=False
    )
    assert by_name == by_object


def test_model_compiled_with_unregistered_objects(mixed):
    """The copies diagnose makes are not compiled: a model compiled with a
    loss class Keras cannot deserialise still works, and stays compiled."""

    class UnregisteredLoss(keras.losses.Loss):
        def call(self, y_true, y_pred):
            return keras.losses.sparse_categorical_crossentropy(
                y_true, y_pred, from_logits=True
            )

    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10, dtype="float32")(hidden))
    model.compile(keras.optimizers.SGD(), UnregisteredLoss())
    x, y = _digits_batch()
    report = tf_als.diagnose(model, x, y, verbose=False)
    assert [r.layer for r in report.rows] == [l.name for l in model.layers if l.weights]
    assert model.compiled


def test_needs_a_loss(mixed):
    model = test_underflow._build()
    x, y = _digits_batch()
    with pytest.raises(ValueError, match="loss="):
        tf_als.diagnose(model, x, y)


def test_works_on_a_subclassed_model(mixed):
    case = _case("subclassed")
    reference, model = case.build_pair()
    assert graph.is_subclassed(model)
    x, y = case.data()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    report = tf_als.diagnose(model, x, y, loss=loss, verbose=False)
    instrumented = tf_als.instrument(model)
    weighted = [
        info.name for info, layer in zip(tf_als.points(instrumented), tuple(p.layer for p in instrumented.point_records))
        if composite.point_weights(layer)
    ]
    assert [r.point for r in report.rows] == weighted
    # The head's numbers against an independent float32 computation.
    _check_row(report, model.head, model, reference, x, y, loss)


def test_underflowing_checks_its_scaling_argument(mixed):
    report = diagnosis.Diagnosis(
        rows=(), keras_loss_scale=1.0, als_loss_scale=1.0, non_finite=None
    )
    with pytest.raises(ValueError, match='`scaling` must be "keras" or "tf_als"; received \'als\''):
        report.underflowing(scaling="als")


def _with_operators():
    """A Functional model whose graph holds `keras.ops` operations made by
    Python operators on symbolic tensors (`x + y`, `x * 0.5`), as
    MobileNetV3 and ConvNeXt build theirs."""
    inputs = keras.Input((64,))
    a = layers.Dense(32, activation="relu", name="a")(inputs)
    b = layers.Dense(32, activation="relu", name="b")(inputs)
    x = (a + b) * 0.5
    outputs = layers.Dense(10, dtype="float32", name="head")(x)
    return keras.Model(inputs, outputs)


def _with_lambda():
    inputs = keras.Input((64,))
    x = layers.Dense(32, name="a")(inputs)
    x = layers.Lambda(lambda t: keras.ops.tanh(t) * 2.0)(x)
    outputs = layers.Dense(10, dtype="float32", name="head")(x)
    return keras.Model(inputs, outputs)


class _Unused(layers.Layer):
    """A Dense with an extra trainable weight its call never reads."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 10), name="kernel")
        self.spare = self.add_weight(shape=(3,), name="spare")

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.cast(self.kernel, x.dtype))


def _with_unused_variable():
    inputs = keras.Input((64,))
    x = layers.Dense(32, activation="relu", name="a")(inputs)
    outputs = layers.Activation("linear", dtype="float32")(_Unused(name="head")(x))
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize(
    "build", [_with_operators, _with_lambda, _with_unused_variable],
    ids=["operators", "lambda", "unused_variable"],
)
def test_works_without_a_config_round_trip(mixed, build):
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    reference = build()
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = build()
    model.set_weights(reference.get_weights())
    x, y = _digits_batch()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    policies = [layer.dtype_policy.name for layer in model.layers]
    report = tf_als.diagnose(model, x, y, loss=loss, verbose=False)
    assert [layer.dtype_policy.name for layer in model.layers] == policies
    _check_row(report, model.get_layer("head"), model, reference, x, y, loss)
    if build is _with_unused_variable:
        assert report.no_gradient == ("head/spare",)
        assert "no gradient (the loss does not reach these variables): head/spare" in str(report)
    else:
        assert report.no_gradient == ()


def test_works_on_llama_with_tied_embeddings(mixed):
    import keras_hub

    def build():
        backbone = keras_hub.models.LlamaBackbone(
            num_query_heads=2, num_key_value_heads=1, dropout=0.0,
            tie_word_embeddings=True, **architectures._HUB_TEXT,
        )
        inputs = backbone.input
        logits = backbone.token_embedding(backbone(inputs), reverse=True)
        outputs = layers.Activation("linear", dtype="float32")(logits)
        return keras.Model(inputs, outputs)

    case = architectures.Case("tied", build, architectures._lm_tokens, _case("llama").loss)
    reference, model = case.build_pair()
    x, y = case.data()
    report = tf_als.diagnose(model, x, y, loss=case.loss, verbose=False)
    assert any(r.point.endswith("self_attention/query") for r in report.rows)
    head = model.layers[2].token_embedding  # the backbone's, tied to the logits
    _check_row(report, head, model, reference, x, y, case.loss)


@pytest.mark.slow
@pytest.mark.parametrize(
    "application", ["MobileNetV3Small", "ConvNeXtTiny", "EfficientNetV2B0"]
)
def test_works_on_keras_applications(mixed, application):
    def build():
        # Without the preprocessing layer: keras.layers.Normalization
        # fixes its mean and variance in its compute dtype when built, so a
        # float16 build keeps float16 constants under a float32 policy.
        return getattr(keras.applications, application)(
            weights=None, input_shape=(32, 32, 3), classes=10,
            classifier_activation=None, include_preprocessing=False,
        )

    case = architectures.Case(application, build, lambda: architectures._images(batch=4, size=32), _case("resnet").loss)
    reference, model = case.build_pair()
    x, y = case.data()
    report = tf_als.diagnose(model, x, y, loss=case.loss, training=False, verbose=False)
    assert report.rows
    head = [layer for layer in model.layers if layer.trainable_weights][-1]
    _check_row(report, head, model, reference, x, y, case.loss, training=False)


def overflowing_forward():
    """`big` multiplies by its kernel x 1e5: its float16 output overflows
    to inf (float32 holds it), and the LayerNormalization after it would
    have brought the values back to order one."""
    inputs = keras.Input((16,))
    x = layers.Dense(32, name="first")(inputs)
    x = layers.Dense(32, name="big")(x)
    x = layers.LayerNormalization(name="norm")(x)
    outputs = layers.Dense(4, dtype="float32", name="head")(x)
    model = keras.Model(inputs, outputs)
    big = model.get_layer("big")
    big.kernel.assign(big.kernel * 1e5)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16)).astype("float32")
    return model, x, rng.integers(0, 4, size=(32,))


def test_names_the_layer_whose_float16_output_overflows(mixed):
    model, x, y = overflowing_forward()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    report = tf_als.diagnose(model, x, y, loss=loss, verbose=False)
    # The first-batch check's search names it (the same answer as fit's).
    assert report.non_finite.startswith(
        "Layer 'big' fails in float16 (float16 forward output not finite); "
        "float32 runs the batch cleanly. Give layer 'big' dtype='float32'"
    ), report.non_finite
    assert report.float16_failures == (("big", "float16 forward output not finite"),)
    assert report.keras_loss_scale is None
    assert forward_search.first_non_finite_output(model, x) == "big"
    # Every output finite: nothing to name.
    model.get_layer("big").dtype_policy = "float32"
    assert forward_search.first_non_finite_output(model, x) is None


# Same randomness in every run ------------------------------------------------


def _gpt2_lm(dropout):
    """A tiny KerasHub GPT-2 with a language-model head (float32 logits)."""
    import keras_hub

    def backbone():
        return keras_hub.models.GPT2Backbone(
            vocabulary_size=128, num_layers=2, num_heads=2, hidden_dim=32,
            intermediate_dim=64, max_sequence_length=16, dropout=dropout,
        )

    return architectures.causal_lm(backbone)()


def test_gpt2_with_dropout_reads_as_without(mixed):
    """GPT-2 tiny with dropout 0.1 and with dropout 0, same weights: the
    worst gradient error of each scaling is the same within float16
    rounding. Before the three runs shared their random draws, dropout
    0.1 read 1.06 (Keras) and 0.93 (tf_als) against 1.2e-3 without.

    Tolerance: both are float16 rounding, 1.1e-3 to 1.5e-3 here, of two
    different computations (dropout zeroes a tenth of the activations and
    scales the rest by 1/0.9), so they may differ by an amount of that
    order; they must agree within float16's unit roundoff, 2**-11 (4.9e-4),
    and stay below 2**-8."""
    with_dropout = _gpt2_lm(0.1)
    without = _gpt2_lm(0.0)
    without.set_weights(with_dropout.get_weights())
    x, y = architectures._lm_tokens(vocabulary=128)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reports = [
        tf_als.diagnose(model, x, y, loss=loss, verbose=False)
        for model in (with_dropout, without)
    ]
    assert len(reports[0].rows) == len(reports[1].rows) > 10
    for field in ("keras_error", "als_error"):
        worst = [max(getattr(row, field) for row in r.rows) for r in reports]
        assert max(worst) < 2.0**-8, (field, worst)
        assert abs(worst[0] - worst[1]) <= 2.0**-11, (field, worst)
    assert all(r.forward_overflow is None for r in reports)


class _UnseededDropout(layers.Layer):
    """Drops with Keras's global seed generator (`seed=None`)."""

    def call(self, x, training=False):
        return keras.random.dropout(x, 0.5) if training else x


def _random_layers():
    """Every kind of random draw a model makes in training: an augmentation,
    dropout (seeded and unseeded), Gaussian noise and dropout, and a
    BatchNormalization whose moving statistics training updates."""
    inputs = keras.Input((8, 8, 3))
    x = layers.RandomFlip(seed=1)(inputs)
    x = layers.Conv2D(8, 3, activation="relu", name="conv")(x)
    x = layers.BatchNormalization(name="norm")(x)
    x = layers.Flatten()(x)
    x = layers.Dropout(0.5)(x)
    x = layers.Dense(32, activation="relu", name="dense")(x)
    x = layers.GaussianNoise(0.5)(x)
    x = layers.GaussianDropout(0.3)(x)
    x = _UnseededDropout()(x)
    outputs = layers.Dense(4, dtype="float32", name="head")(x)
    return keras.Model(inputs, outputs)


def _random_batch():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 8, 8, 3)).astype("float32"), rng.integers(0, 4, 16)


def test_every_run_draws_the_same_masks_and_noise(mixed):
    """With every random layer active, the rows read float16 rounding, where
    runs that drew their own masks and noise read 0.76 to 1.25 on every row
    (measured). `norm`, `dense` and `head`: below 2**-7. `conv`'s kernel
    gradient is 6.1e-2 off on this batch, and that is the batch's: the
    same model without its RandomFlip, given the batch flipped as the
    layer flips it, reads the same numbers (to 1e-6, relative)."""
    model = _random_layers()
    x, y = _random_batch()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    report = tf_als.diagnose(model, x, y, loss=loss, verbose=False)
    assert [r.layer for r in report.rows] == ["conv", "norm", "dense", "head"]
    for row in report.rows:
        bound = 2.0**-3 if row.layer == "conv" else 2.0**-7
        assert row.keras_error < bound and row.als_error < bound, row

    flip = model.layers[1]
    state = np.array(flip.generator.state.value)
    with _keras.dtype_policy([flip], "float32"):
        flipped = np.asarray(flip(x, training=True))
    flip.generator.state.assign(state)
    inputs = keras.Input((8, 8, 3))
    outputs = inputs
    for layer in model.layers[2:]:
        outputs = layer(outputs)
    unflipped = tf_als.diagnose(
        keras.Model(inputs, outputs), flipped, y, loss=loss, verbose=False
    )
    for row, same in zip(report.rows, unflipped.rows, strict=True):
        assert row.keras_error == pytest.approx(same.keras_error, rel=1e-6)
        assert row.als_error == pytest.approx(same.als_error, rel=1e-6)


def test_leaves_the_model_and_keras_random_state_as_found(mixed):
    """Weights, moving statistics and seed states bitwise as they were, and
    Keras's random ops as they were: no global seed generator made, and a
    float16 dropout drawing its native mask again."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    model = _random_layers()
    x, y = _random_batch()
    model(x, training=True)  # Seed states and moving statistics move off their start.
    before = [np.array(v.value) for v in model.variables]
    paths = [v.path for v in model.variables]
    assert any("seed_generator_state" in p for p in paths)
    assert any("moving_mean" in p for p in paths)
    key = seed_generator.GLOBAL_SEED_GENERATOR
    global_state.set_global_attribute(key, None)
    half = tf.ones((64, 64), tf.float16)
    native = keras.random.dropout(half, 0.5, seed=3)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    tf_als.diagnose(model, x, y, loss=loss, verbose=False)
    for path, old, variable in zip(paths, before, model.variables):
        np.testing.assert_array_equal(np.array(variable.value), old, err_msg=path)
    assert global_state.get_global_attribute(key) is None
    np.testing.assert_array_equal(keras.random.dropout(half, 0.5, seed=3), native)


# Overflow is not underflow ---------------------------------------------------


def soft_dice(y_true, y_pred):
    """1 - 2 sum(p y) / (sum(p) + sum(y)), summed in y_pred's dtype."""
    y_true = tf.cast(y_true, y_pred.dtype)
    overlap = tf.reduce_sum(y_pred * y_true)
    return 1.0 - 2.0 * overlap / (tf.reduce_sum(y_pred) + tf.reduce_sum(y_true))


def _segmenter():
    """A per-pixel sigmoid over a 16 x 96 x 96 batch: sum(p) is about
    74,000, past float16's 65504."""
    inputs = keras.Input((96, 96, 3))
    x = layers.Conv2D(8, 3, padding="same", activation="relu", name="conv")(inputs)
    outputs = layers.Conv2D(1, 1, activation="sigmoid", name="mask")(x)
    model = keras.Model(inputs, outputs)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 96, 96, 3)).astype("float32")
    return model, x, (rng.random((16, 96, 96, 1)) < 0.5).astype("float32")


def test_a_float16_soft_dice_is_an_overflow_in_the_loss(mixed):
    """The float16 loss sits at exactly 1 and every float16 gradient is 0
    (float32's loss is about 0.5, its gradients nonzero): reported as an
    overflow in the loss, with the cast to float32 as the fix."""
    model, x, y = _segmenter()
    assert float(soft_dice(y, model(x))) == 1.0
    report = tf_als.diagnose(model, x, y, loss=soft_dice, verbose=False)
    assert [r.keras_underflow for r in report.rows] == [1.0, 1.0]
    assert report.non_finite is None
    assert report.forward_overflow == "loss"
    assert report.overflow_advice().startswith("Not underflow: overflow in the loss.")
    assert 'tf.cast(y_pred, "float32")' in str(report)


@pytest.mark.slow
def test_the_soft_dice_fix_leaves_float16_rounding(mixed):
    """The advice followed (the loss on float32 predictions): no overflow,
    and Keras's gradients within float16 rounding of float32's (2**-7).
    Slow because tf_als backs off to a global scale of 2**-9 here, one
    traced run per halving: the biases' gradients sum 147,456 positions
    and overflow float16 at higher scales."""
    model, x, y = _segmenter()

    def fixed(y_true, y_pred):
        return soft_dice(y_true, tf.cast(y_pred, "float32"))

    report = tf_als.diagnose(model, x, y, loss=fixed, verbose=False)
    assert report.forward_overflow is None and report.overflow_advice() is None
    assert all(r.keras_error < 2.0**-7 for r in report.rows), report.rows


class _HandNorm(layers.Layer):
    """x / sqrt(mean(x**2)), as hand-written normalisations compute it: in
    float16, x**2 passes 65504 for |x| > 256 and the output is 0."""

    def call(self, x):
        return x / keras.ops.sqrt(keras.ops.mean(keras.ops.square(x)) + 1e-3)


def test_names_the_layer_whose_float16_sum_overflows_inside(mixed):
    """`norm`'s inputs agree with float32's but its float16 output is 0
    (finite): it is named, and giving it dtype="float32" fixes it."""
    inputs = keras.Input((16,))
    x = layers.Dense(32, name="big")(inputs)
    x = _HandNorm(name="norm")(x)
    outputs = layers.Dense(4, dtype="float32", name="head")(x)
    model = keras.Model(inputs, outputs)
    big = model.get_layer("big")
    big.kernel.assign(big.kernel * 1000.0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 16)).astype("float32"), rng.integers(0, 4, 32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    report = tf_als.diagnose(model, x, y, loss=loss, verbose=False)
    assert report.non_finite is None
    assert report.forward_overflow == "norm", str(report)
    assert "layer 'norm' is the first" in report.overflow_advice()
    model.get_layer("norm").dtype_policy = "float32"
    report = tf_als.diagnose(model, x, y, loss=loss, verbose=False)
    assert report.forward_overflow is None
    assert all(r.keras_error < 2.0**-7 for r in report.rows), report.rows


class _Squash(layers.Layer):
    """tanh(x / 2**20): below one in float32 for x up to ~10**6, and 1 with
    a zero gradient for float16's inf (divided in two steps: 2**20 is not
    a float16)."""

    def call(self, x):
        return keras.ops.tanh(x / 4096.0 / 256.0)


def test_names_the_layer_whose_float16_output_is_inf(mixed):
    """`big` (every kernel entry 30000, after a ReLU) sums past 65504: inf
    in float16, ~4 * 10**5 in float32. `squash` turns inf into a finite 1 with a
    zero gradient, so nothing is non-finite, `first`'s and `big`'s float16
    gradients are all zero (float32's are not), and `big` is named."""
    inputs = keras.Input((16,))
    x = layers.Dense(32, activation="relu", name="first")(inputs)
    x = layers.Dense(32, name="big")(x)
    x = _Squash(name="squash")(x)
    outputs = layers.Dense(4, dtype="float32", name="head")(x)
    model = keras.Model(inputs, outputs)
    model.get_layer("big").kernel.assign(np.full((32, 32), 30000.0, "float32"))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 16)).astype("float32"), rng.integers(0, 4, 32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    report = tf_als.diagnose(model, x, y, loss=loss, verbose=False)
    assert report.non_finite is None
    assert report.underflowing(0.5) == ["first", "big"]
    assert report.forward_overflow == "big", str(report)
    assert "Not underflow: overflow in the forward pass" in str(report)


def test_underflow_that_no_scaling_lifts_is_still_underflow(mixed):
    """A loss scaled by 1e-20 in float32: its gradient underflows at the
    float16 boundary whatever the scales (2**30 at most lifts 1e-21 to
    1e-12), so both scalings flush the hidden layers and the overflow
    check runs, finds every layer and the loss in agreement (within
    rounding), and reports underflow."""
    inputs = keras.Input((16,))
    x = layers.Dense(32, activation="relu", name="a")(inputs)
    x = layers.Dense(32, activation="relu", name="b")(x)
    model = keras.Model(inputs, layers.Dense(4, dtype="float32", name="head")(x))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 16)).astype("float32"), rng.integers(0, 4, 32)

    def tiny(y_true, y_pred):
        return 1e-20 * keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=True
        )

    report = tf_als.diagnose(model, x, y, loss=tiny, verbose=False)
    assert report.underflowing(0.5) == ["a", "b"]
    assert report.underflowing(0.5, scaling="tf_als") == ["a", "b"]
    assert report.forward_overflow is None and report.non_finite is None
    assert "Not underflow" not in str(report)
