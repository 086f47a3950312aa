"""`nonfinite`: the search loop over batches and the helpers the forward
and backward searches share (the searches themselves are tested in
test_promote, test_promote_backward, test_locate and test_report)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_als._src.failures import backward_search
from tf_als._src.failures import forward_search
from tf_als._src.failures import nonfinite

layers = keras.layers
INF = float("inf")


def _counted(batches, drawn):
    for batch in batches:
        drawn.append(batch)
        yield batch


def test_search_stops_at_the_first_finding_and_draws_no_more():
    drawn = []
    found = nonfinite.Finding("b", nonfinite.FORWARD_OUTPUT)
    finding = nonfinite.search(
        lambda b: found if b == 2 else None, _counted(range(10), drawn), limit=8
    )
    assert finding == found
    assert drawn == [0, 1, 2]


def test_search_tries_at_most_limit_batches():
    drawn = []
    assert nonfinite.search(lambda b: None, _counted(range(10), drawn), limit=3) is None
    assert drawn == [0, 1, 2]
    # A finding past the limit is not seen.
    found = nonfinite.Finding("late", nonfinite.WEIGHTS)
    assert nonfinite.search(lambda b: found if b == 3 else None, range(10), 3) is None
    assert nonfinite.search(lambda b: found, range(10), 0) is None


@pytest.mark.parametrize("limit", [-1, 2.0, True, None])
def test_search_names_a_bad_limit(limit):
    with pytest.raises(ValueError, match="`limit` must be an int >= 0"):
        nonfinite.search(lambda b: None, [1], limit)


def test_all_finite_reads_float_tensors_only():
    finite = tf.constant([1.0, 2.0])
    assert nonfinite.all_finite([finite, None, {"n": tf.constant([3])}])
    assert not nonfinite.all_finite({"a": finite, "b": (tf.constant([INF], tf.float16),)})
    assert not nonfinite.all_finite(tf.constant([np.nan]))
    assert nonfinite.all_finite(None)


def test_all_finite_reads_an_indexed_slices_gradient_by_its_values():
    def slices(values):
        return tf.IndexedSlices(tf.constant(values), tf.constant([0, 2]))

    assert nonfinite.all_finite(slices([1.0, 2.0]))
    assert not nonfinite.all_finite(slices([1.0, INF]))


def test_floats_keeps_float_tensors_in_order():
    a, b = tf.constant(1.0), tf.constant(2.0, tf.float16)
    assert nonfinite.floats(([a, tf.constant(3)], {"x": b}, "text")) == [a, b]


class _Block(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = layers.Dense(2, name="inner")

    def call(self, x):
        return self.inner(x)


def test_layer_path_is_the_path_or_else_the_name():
    block = _Block(name="block")
    assert nonfinite.layer_path(block.inner) == "inner"  # not built: no path
    block(np.ones((1, 3), "float32"))
    assert nonfinite.layer_path(block.inner) == "block/inner"


def test_preserved_puts_variables_back():
    variable = keras.Variable(np.array([1.0, 2.0], "float32"))
    with nonfinite.preserved([variable]):
        variable.assign([5.0, 6.0])
        np.testing.assert_array_equal(variable.numpy(), [5.0, 6.0])
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])


def _overflowing_model():
    """`big` multiplies by 1e4 in float16: inf for inputs of 10 (float16
    holds at most 65504), finite for inputs of 0."""
    inputs = keras.Input((2,))
    x = layers.Dense(2, name="first")(inputs)
    x = layers.Rescaling(1e4, name="big", dtype="mixed_float16")(x)
    return keras.Model(inputs, layers.Dense(1, name="last")(x))


def test_forward_search_answers_with_a_finding_from_the_first_failing_batch():
    model = _overflowing_model()
    first = model.get_layer("first")
    first.set_weights([np.eye(2, dtype="float32"), np.zeros(2, "float32")])
    quiet, loud = np.zeros((1, 2), "float32"), np.full((1, 2), 10.0, "float32")
    drawn = []
    finding = forward_search.search(model, _counted([quiet, loud, loud], drawn))
    assert finding == nonfinite.Finding("big", nonfinite.FORWARD_OUTPUT)
    assert len(drawn) == 2
    assert forward_search.first_non_finite_output(model, loud) == "big"
    assert forward_search.search(model, [quiet, quiet]) is None


def test_backward_search_names_the_loss_itself():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, layers.Dense(1, name="only")(inputs))

    def loss_fn(x, y, y_pred, sample_weight):
        return tf.reduce_mean(y_pred) * INF

    batch = (np.ones((1, 2), "float32"), None, None)
    finding = backward_search.search(model, loss_fn, [batch], scale=1.0)
    assert finding == nonfinite.Finding(None, nonfinite.LOSS_VALUE)
