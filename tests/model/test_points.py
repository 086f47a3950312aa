"""`points.Point`: one record per scaling point, from which the plan's and
the instrumented model's views of the points are read."""

import contextlib
import dataclasses

import keras
import pytest

import tf_als
from tests import architectures
from tf_als._src.model import points

layers = keras.layers


def _attention_model():
    """A Dense layer called twice, an opened `MultiHeadAttention`, a head."""
    inputs = keras.Input((4, 8))
    shared = layers.Dense(8, name="shared")
    x = shared(shared(inputs))
    x = layers.MultiHeadAttention(2, 4, name="attention")(x, x)
    outputs = layers.Dense(3, name="head", dtype="float32")(x)
    return keras.Model(inputs, outputs)


def test_records_of_a_functional_model(mixed):
    model = _attention_model()
    instrumented = tf_als.instrument(model)
    records = instrumented.point_records
    attention = model.get_layer("attention")
    # The plan's calls first, in call order, then the projections inside
    # the attention (Keras's attribute order), each inside point 2.
    assert [(p.index, p.name, p.kind, p.call, p.parent) for p in records] == [
        (0, "shared/call_0", "call", 0, None),
        (1, "shared/call_1", "call", 1, None),
        (2, "attention", "call", 2, None),
        (3, "head", "call", 3, None),
        (4, "attention/query", "inner", None, 2),
        (5, "attention/key", "inner", None, 2),
        (6, "attention/value", "inner", None, 2),
        (7, "attention/attention_output", "inner", None, 2),
    ]
    assert records[0].layer is records[1].layer is model.get_layer("shared")
    assert records[2].layer is attention
    assert [p.layer for p in records[4:]] == [
        attention.query_dense, attention.key_dense,
        attention.value_dense, attention.output_dense,
    ]
    # The plan holds its own points, the same records.
    assert instrumented.plan.points == records[:4]
    assert all(a is b for a, b in zip(instrumented.plan.points, records))


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c.name)
        for c in architectures.CASES
        if c.name
        in ("shared_layer", "nested", "composite_layers", "subclassed", "lstm")
    ],
)
def test_every_view_is_read_from_the_records(mixed, case):
    _, model = case.build_pair()
    closed = case.name == "lstm"  # Warned about: its LSTMs stay closed.
    warns = pytest.warns(UserWarning, match="stay one scaling point")
    with warns if closed else contextlib.nullcontext():
        instrumented = tf_als.instrument(model)
    records = instrumented.point_records
    plan = instrumented.plan
    assert [p.index for p in records] == list(range(len(records)))
    names = [p.name for p in records]
    assert list(tf_als.scales(instrumented)) == names
    assert list(instrumented.scaling_state.point_names) == names
    assert [p.point_name for p in instrumented.scaling_points] == names
    assert [p.index for p in instrumented.scaling_points] == list(range(len(names)))
    assert tf_als.points(instrumented) == [p.info() for p in records]
    assert [i.name for i in tf_als.points(instrumented)] == names
    for p in records:
        if p.kind == points.CALL:
            call = plan.calls[p.call]
            assert call.point == p.index and call.operation is p.layer
        elif p.kind == points.INNER:
            assert p.name.startswith(records[p.parent].name + "/")
    # A point of the plan for every call with a point, and no other.
    assert sorted(p.call for p in records if p.kind == points.CALL) == [
        c.index for c in plan.calls if c.point is not None
    ]


def test_a_subclassed_model_is_a_root_with_points_inside(mixed):
    instrumented = tf_als.instrument(architectures.subclassed())
    root, *inside = instrumented.point_records
    assert (root.index, root.kind, root.call, root.parent) == (0, "root", None, None)
    assert root.layer is instrumented.uninstrumented()
    assert instrumented.plan.points == ()
    assert inside and all(p.kind == points.INNER for p in inside)
    assert any(p.parent == 0 for p in inside)
    assert all(
        p.name.startswith(instrumented.point_records[p.parent].name + "/")
        for p in inside
    )


def test_a_record_is_frozen(mixed):
    record = tf_als.instrument(_attention_model()).point_records[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.name = "renamed"


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(kind="layer"), "`kind` must be one of"),
        (dict(kind="call"), "`call` must be a call index"),
        (dict(kind="inner", call=3, parent=0), "`call` must be a call index"),
        (dict(kind="inner"), "`parent` must be the index of an earlier"),
        (dict(kind="inner", parent=2), "`parent` must be the index of an earlier"),
        (dict(kind="root", parent=0), "`parent` must be the index of an earlier"),
        (dict(kind="call", call=1, parent=0), "`parent` must be the index of an"),
    ],
    ids=[
        "unknown kind", "call without index", "inner with call",
        "inner without parent", "parent not earlier", "root with parent",
        "call with parent",
    ],
)
def test_a_record_that_does_not_fit_its_kind_is_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        points.Point(index=2, name="p", layer=None, **arguments)
