"""`locate`: the walk from the loss that names the scaling point where
gradients turned non-finite, on the plan of a model with a fork and a shared
layer (the storm and diagnose tests cover it end to end)."""

import keras
import pytest

import tf_als
from tf_als._src.failures import locate

layers = keras.layers
pytestmark = pytest.mark.usefixtures("mixed")


def _plan():
    """a -> b -> shared, with a skip a -> add; shared is called twice:
    inputs -> a -> b -> shared -> add(., a) -> shared -> head."""
    inputs = keras.Input((4,))
    a = layers.Dense(4, name="a")(inputs)
    b = layers.Dense(4, name="b")(a)
    shared = layers.Dense(4, name="shared")
    x = layers.Add(name="add")([shared(b), a])
    x = shared(x)
    outputs = layers.Dense(2, name="head")(x)
    plan = tf_als.instrument(keras.Model(inputs, outputs)).plan
    return plan, {p.name: p.call for p in plan.points}


def test_points_in_order_from_the_loss():
    plan, calls = _plan()
    assert sorted(calls) == sorted(["a", "b", "shared/call_0", "shared/call_1", "head"])


def test_all_finite_names_nobody():
    plan, calls = _plan()
    assert locate.first_non_finite(plan, lambda i: True) is None
    incoming = {i: True for i in calls.values()}
    assert locate.first_non_finite(plan, lambda i: True, incoming) is None


def test_weight_gradients_of_the_point_closest_to_the_loss():
    plan, calls = _plan()
    bad = {calls["b"], calls["a"]}
    culprit = locate.first_non_finite(plan, lambda i: i not in bad)
    assert (culprit.point, culprit.layer, culprit.what) == ("b", "b", "weight gradients")
    assert culprit.receivers == ("shared/call_0",)


def test_a_fork_receives_from_every_consumer():
    plan, calls = _plan()
    culprit = locate.first_non_finite(plan, lambda i: i != calls["a"])
    # `a` feeds `b` and, through the weightless add, the second shared call.
    assert set(culprit.receivers) == {"b", "shared/call_1"}


def test_shared_layer_blames_the_call_closest_to_the_loss():
    plan, calls = _plan()
    shared = {calls["shared/call_0"], calls["shared/call_1"]}
    culprit = locate.first_non_finite(plan, lambda i: i not in shared)
    assert culprit.point == "shared/call_1"
    assert culprit.receivers == ("head",)


def test_head_receives_from_the_loss():
    plan, calls = _plan()
    culprit = locate.first_non_finite(plan, lambda i: i != calls["head"])
    assert culprit.receivers == ()


def test_input_gradient_blames_the_point_that_passed_it_on():
    """`shared/call_1` is reached by a finite gradient, has finite weight
    gradients, and hands a non-finite one to `shared/call_0` (through the
    add) and to `a`: its input gradient is to blame."""
    plan, calls = _plan()
    incoming = {i: True for i in calls.values()}
    for name in ("shared/call_0", "b", "a"):
        incoming[calls[name]] = False
    culprit = locate.first_non_finite(plan, lambda i: True, incoming)
    assert (culprit.point, culprit.what) == ("shared/call_1", "input gradient")


@pytest.mark.parametrize("blocked", [("head",), ("head", "shared/call_1")])
def test_points_reached_by_non_finite_gradients_are_not_blamed(blocked):
    plan, calls = _plan()
    incoming = {i: True for i in calls.values()}
    for name in blocked:
        incoming[calls[name]] = False
    # Every weight gradient is non-finite: the first point reached by a
    # finite gradient is the one to blame.
    culprit = locate.first_non_finite(plan, lambda i: False, incoming)
    expected = {("head",): "shared/call_1", ("head", "shared/call_1"): "shared/call_0"}
    assert culprit.point == expected[blocked]
