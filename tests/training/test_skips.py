"""tf_als never costs more skipped steps than Keras's loss scaling.

A per-layer scale lifts the gradient for every layer upstream of it, and
gradients often grow on the way back (through each LayerNormalization of a
post-LN Transformer, through weight-gradient sums over the batch). A lift
that leaves no headroom further up would overflow there: a skipped step and
a halved global scale, which grows back only after `dynamic_growth_steps`
(2000) finite steps, and Keras's single scale would not have skipped. The
rule gives such lift back (`rule.choose_scale`, `inherited`), and
since it follows the gradient on every step, a scale chosen before the
weights moved never outlives them (keras.applications ConvNeXtTiny, whose
LayerScale grows by orders of magnitude in Adam's first steps, skipped 6 of
its first 8 steps when the scales were re-chosen every 100 steps).

Each test trains the same model from the same weights on the same batches
twice, with Keras's `LossScaleOptimizer` and with tf_als, and compares the
skipped steps (steps the inner optimizer did not apply) and the global
scale at the end.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tests import architectures
from tests import gradients


def _run(build, loss, batches, instrumented, **optimizer_kwargs):
    """(skipped steps, final global scale, model, optimizer) of one run
    from seed 0."""
    keras.utils.set_random_seed(0)
    model = build()
    inner = keras.optimizers.Adam(1e-3)
    if instrumented:
        model = tf_als.instrument(model)
        optimizer = tf_als.AdaptiveLossScaleOptimizer(
            inner, max_consecutive_skips=None, **optimizer_kwargs
        )
    else:
        optimizer = keras.optimizers.LossScaleOptimizer(inner)
    model.compile(optimizer=optimizer, loss=loss, jit_compile=False)
    steps = 0
    for _ in batches:
        steps += 1
    model.fit(batches, epochs=1, verbose=0, shuffle=False)
    applied = int(keras.ops.convert_to_numpy(inner.iterations))
    scale = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
    if instrumented:
        _check_lift(model)
    return steps - applied, scale, model, optimizer


def _check_lift(model):
    """Every point's gradients carry T_in >= 1: giving lift back never goes
    below Keras's global scale alone."""
    for point in model.scaling_points:
        state = point.read()
        assert state["cumulative_scale"] >= 1.0, (point.point_name, state)


def _compare(build, loss, batches, **optimizer_kwargs):
    """Asserts tf_als skips no more steps than Keras and ends at no lower
    global scale (one power of two lower where it skipped fewer); returns
    tf_als's trained model and optimizer."""
    keras_skips, keras_scale, _, _ = _run(build, loss, batches, False)
    als_skips, als_scale, model, optimizer = _run(
        build, loss, batches, True, **optimizer_kwargs
    )
    what = (
        f"keras: {keras_skips} skipped, S = 2**{np.log2(keras_scale):g}; "
        f"tf_als: {als_skips} skipped, S = 2**{np.log2(als_scale):g}"
    )
    assert als_skips <= keras_skips, what
    # Since 0.4 tf_als chooses its first global scale on the first batch,
    # by an eager re-run, instead of skipping its way down; the eager
    # float16 kernels may round differently from the compiled step's, and
    # the scale chosen can be one power of two below where Keras's skips
    # end (measured on ResNet50: Keras 12 skips, S = 2**3; tf_als 0 skips,
    # S = 2**2). Without that saving, no lower scale at all.
    if als_skips < keras_skips:
        assert als_scale >= keras_scale / 2.0, what
    else:
        assert als_scale >= keras_scale, what
    return model, optimizer, keras_skips


def _query_key_errors(model, optimizer, build, loss, x, y):
    """{variable path: relative error against float32} of every attention
    query and key kernel gradient at `model`'s trained weights, on the
    batch (x, y), as tf_als computes it in its state after training (the
    same per-layer scales rule and global scale; learning rate 0)."""
    with _policy("float32"):
        reference = build()
    reference.set_weights(model.uninstrumented().get_weights())
    expected = gradients.float32_gradients(reference, x, y, loss)
    recorder = tf_als.AdaptiveLossScaleOptimizer(
        gradients.GradientRecorder(), max_consecutive_skips=None
    )
    recorder.build(model.trainable_variables)
    recorder.dynamic_scale.assign(optimizer.dynamic_scale)
    als, _ = gradients.applied_gradients(model, recorder, x, y, loss)
    errors = {}
    for variable, got, truth in zip(model.uninstrumented().trainable_variables, als, expected):
        if variable.path.endswith(("query/kernel", "key/kernel")):
            errors[variable.path] = gradients.compare(got, truth)["relative_error"]
    return errors


@contextlib.contextmanager
def _policy(name):
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


class _Weighted(keras.losses.Loss):
    """Cross-entropy times a small weight (an auxiliary loss, or a loss
    averaged over many tokens): small gradients, so tf_als lifts a lot."""

    def __init__(self, weight):
        super().__init__(name="weighted_cross_entropy")
        self.weight = weight

    def call(self, y_true, y_pred):
        return self.weight * keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=True
        )


@pytest.mark.parametrize(
    "weight",
    [
        pytest.param(1.0, marks=pytest.mark.slow, id="loss_x1"),
        # 40-90 s in the full default suite: slow too (CI runs both).
        pytest.param(0.01, marks=pytest.mark.slow, id="loss_x0.01"),
    ],
)
def test_post_ln_transformer_skips_no_more_than_keras(mixed, weight):
    """A 2-block post-LN Transformer with Adam (300 steps at weight 1, in
    the slow suite; 100 at weight 0.01, where the skips came in the first
    steps). Measured over 300 steps with
    the loss weighted 0.01 before lift could be given back: Keras 0
    skipped steps and S = 2**15; tf_als 2 and 2**13 (the lift of 64 chosen
    at the last LayerNormalization overflowed the first attention block's
    output-projection gradients one step after it was chosen). With
    weight 1 both skip 2 steps at the start and end at 2**13."""
    x, y = architectures.post_ln_tokens(300 if weight == 1.0 else 100)
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    loss = _Weighted(weight)
    model, optimizer, _ = _compare(architectures.post_ln_transformer, loss, batches)
    # At the trained weights, on held-out batches, the attention's query
    # and key kernels (whose gradients pass through the softmax's, the
    # smallest in the model) get float32's gradient within 1%. Measured
    # when the scales were re-chosen every 100 steps: 6.5-7.1% (points
    # gave back lift for the interval's worst case); Keras's single scale:
    # 85%.
    held_x, held_y = architectures.post_ln_tokens(2, seed=1)
    for start in (0, 32):
        errors = _query_key_errors(
            model, optimizer, architectures.post_ln_transformer,
            lambda t, p: tf.reduce_mean(loss(t, p)),
            held_x[start : start + 32], held_y[start : start + 32],
        )
        assert len(errors) == 4, errors
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 0.01, errors
    if weight < 1.0:
        # The rule was exercised: with the loss weighted 0.01, the points
        # below the first block's attention give back lift (measured:
        # scales down to 2**-6 at the attention output projection).
        keras.utils.set_random_seed(0)
        model = tf_als.instrument(architectures.post_ln_transformer())
        model.compile(
            optimizer=tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-3)),
            loss=_Weighted(weight),
        )
        model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
        assert min(tf_als.scales(model).values()) < 1.0
        _check_lift(model)


# DenseNet121 (5 minutes here) left this test for the models below, where
# weight-gradient sums overflow; its concatenations stay covered by the
# oracle (tests/test_oracle.py) and the backward search
# (tests/failures/test_promote_backward.py).
_NOT_HERE = ("densenet121",)


def _case_params():
    for case in architectures.ALL_CASES:
        if case.name not in _NOT_HERE:
            yield pytest.param(case, id=case.name)


@pytest.mark.slow
@pytest.mark.parametrize("case", _case_params())
def test_every_model_skips_no_more_than_keras(mixed, case):
    """Every model of the test suite, 30 steps on its batch (12 for the
    heavy ones: keras.applications ResNet50 and DenseNet121 took 3.6 and
    4.8 minutes for 30)."""
    x, y = case.data()
    if isinstance(x, list):
        x, y = tuple(x), tuple(y)
    batches = tf.data.Dataset.from_tensors((x, y)).repeat(12 if case.slow else 30)
    _compare(case.build, case.loss, batches)


def _largest_finite_plain(model, loss, batches, below):
    """The largest power of two at most `below` at which the plain model's
    float16 gradients (Keras's single scale) are finite on every batch."""
    scale = below
    while scale > 1.0:
        finite = True
        for x, y in batches:
            with tf.GradientTape() as tape:
                value = tf.reduce_mean(loss(y, model(x, training=True))) * scale
            grads = tape.gradient(value, model.trainable_variables)
            if not all(bool(tf.reduce_all(tf.math.is_finite(g))) for g in grads):
                finite = False
                break
        if finite:
            return scale
        scale /= 2.0
    return scale


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, size, batch",
    [("unet", 32, 8), ("detector", 64, 8), ("conv3d", 16, 4)],
    ids=["unet_32", "detector_64", "conv3d_16"],
)
def test_where_weight_gradient_sums_overflow(mixed, name, size, batch):
    """Issue 39's models with their losses summed over pixels, voxels or
    anchors, not averaged (`benchmarks/produced_skips.py` measures them at
    full size): every gradient is large and a convolution's weight
    gradients sum it again over batch x positions. 12 steps each; Keras's
    skips are the premise. tf_als skips no more steps than Keras.

    Its final global scale is compared with what its own weights allow:
    a run that skips fewer steps has trained further, and its gradients
    may have grown past Keras's scale (measured on the 3D segmenter: Keras
    skipped 5 steps and ended at 2**10; tf_als skipped 3 and ended at
    2**8, and at its final weights Keras's single scale overflows 4 of the
    12 batches at 2**10 and 1 at 2**9). It must end no more than one power
    of two below the largest scale at which Keras's plain float16 pass is
    finite at those weights on every batch."""
    builders = {
        "unet": lambda: architectures.unet(size, levels=3, width=8),
        "detector": lambda: architectures.detector(size, width=8),
        "conv3d": lambda: architectures.conv3d(size, width=4),
    }
    loss = (
        architectures.detection_loss(normalise=False)
        if name == "detector" else architectures.pixel_loss("sum")
    )
    x, y = architectures.overflow_data(name, size, 12 * batch)
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    keras_skips, keras_scale, _, _ = _run(builders[name], loss, batches, False)
    als_skips, als_scale, model, _ = _run(builders[name], loss, batches, True)
    what = f"keras: {keras_skips} skipped, S = {keras_scale}; tf_als: {als_skips}, S = {als_scale}"
    assert keras_skips >= 1, what  # The premise: the sums overflow Keras's scale.
    assert als_skips <= keras_skips, what
    allowed = _largest_finite_plain(model.uninstrumented(), loss, batches, 2.0**15)
    assert als_scale >= min(keras_scale, allowed) / 2.0, (what, allowed)


def _convnext_tiny():
    return keras.applications.ConvNeXtTiny(
        weights=None, input_shape=(32, 32, 3), classes=10,
        classifier_activation=None,
    )


@pytest.mark.slow
def test_convnext_skips_no_more_than_keras(mixed):
    """keras.applications ConvNeXtTiny (random weights, 32x32, Adam 1e-3,
    batch 8), 12 steps: its LayerScale starts at 1e-6 and Adam's first
    steps grow it by orders of magnitude, so the gradient behind it grows
    as fast. With scales re-chosen every 100 steps, tf_als skipped 6 of
    the first 8 steps (global scale 2**15 -> 2**9) where Keras skipped
    none. (30 steps until issue 40: the failure is in the first 8, and
    the 18 steps after them cost 2.5 minutes of the slow suite.)"""
    steps = 12
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * steps, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(8 * steps,))
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    _compare(_convnext_tiny, loss, batches)
