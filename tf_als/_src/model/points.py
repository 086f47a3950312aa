"""The scaling points of an instrumented model: one frozen record each.

A model's points are found once, by `instrument()`, and each becomes a
`Point`: first the calls of its plan whose layer owns weights (made by
`graph.read`, in call order), then the weighted layers inside each opened
point (`inner`, depth first, in point order); a subclassed model is one
opened root point followed by the layers inside it (`of_subclassed`). The
model holds them as one tuple, `InstrumentedModel.point_records`, in which a
point's position is its index, its row in the `state.ScalingState` and
its entry in `tf_als.scales` and `tf_als.points`. Everything else about the
points (their names, layers, call indices, `PointInfo`s, the state's row
order, which layers are hooked) is read from that tuple.

Example (a Dense layer called twice, then a `MultiHeadAttention`, opened:
its projections are points inside it, and the head):

```python
inputs = keras.Input((4, 8))
shared = keras.layers.Dense(8, name="shared")
x = shared(shared(inputs))
x = keras.layers.MultiHeadAttention(2, 4, name="attention")(x, x)
outputs = keras.layers.Dense(3, name="head", dtype="float32")(x)
model = tf_als.instrument(keras.Model(inputs, outputs))
[(p.index, p.name, p.kind, p.call, p.parent) for p in model.point_records]
# [(0, "shared/call_0", "call", 0, None),
#  (1, "shared/call_1", "call", 1, None),
#  (2, "attention", "call", 2, None),
#  (3, "head", "call", 3, None),
#  (4, "attention/query", "inner", None, 2),
#  (5, "attention/key", "inner", None, 2),
#  (6, "attention/value", "inner", None, 2),
#  (7, "attention/attention_output", "inner", None, 2)]
```
"""

import dataclasses
from typing import Optional

import keras

from tf_als._src.model import _keras
from tf_als._src.model import composite

# Where a point comes from.
CALL = "call"  # A call of the plan: a layer that owns weights, in the graph.
INNER = "inner"  # A weighted layer inside an opened point (run by its hook).
ROOT = "root"  # A subclassed model at the top, run as one opened point.
KINDS = (CALL, INNER, ROOT)


@dataclasses.dataclass(frozen=True)
class Point:
    """One scaling point of a model.

    Attributes:
        index: int, its position among the model's points: its row in the
            `ScalingState`, its place in `tf_als.scales`.
        name: str, its name, as `tf_als.scales` reports it.
        layer: the layer (or, for `"root"`, the subclassed model) it calls.
        kind: `"call"`, a call of the plan (a layer that owns weights, in
            the model's graph); `"inner"`, a weighted layer inside an
            opened point, made a point by its hook while that point runs;
            `"root"`, a subclassed model at the top, run as one opened
            point. (How a layer's weights are scaled, `"layer"`,
            `"composite"` or `"closed"`, is `info().kind`.)
        call: int or None, the index in `Plan.calls` of a `"call"` point's
            call; None for the others.
        parent: int or None, the index of the point an `"inner"` point is
            inside (the nearest enclosing point); None for the others.

    Raises:
        ValueError: `kind` is not one of `KINDS`, or `call` and `parent`
            do not fit it (a call index for `"call"` points only, a parent
            for `"inner"` points only, below the point's own index).
    """

    index: int
    name: str
    layer: object
    kind: str
    call: Optional[int] = None
    parent: Optional[int] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(
                f"Point {self.name!r}: `kind` must be one of {KINDS}; "
                f"received {self.kind!r}."
            )
        if (self.call is not None) != (self.kind == CALL):
            raise ValueError(
                f"Point {self.name!r} of kind {self.kind!r}: `call` must be a "
                f"call index for kind 'call' and None otherwise; received "
                f"{self.call!r}."
            )
        parent_fits = (
            self.parent is None
            if self.kind != INNER
            else isinstance(self.parent, int) and 0 <= self.parent < self.index
        )
        if not parent_fits:
            raise ValueError(
                f"Point {self.name!r} (index {self.index}) of kind "
                f"{self.kind!r}: `parent` must be the index of an earlier "
                f"point for kind 'inner' and None otherwise; received "
                f"{self.parent!r}."
            )

    def info(self) -> "PointInfo":
        """What `tf_als.points` says about this point."""
        kind, reason, layer = "layer", None, self.layer
        weighted_inside = isinstance(
            layer, keras.layers.Layer
        ) and composite.has_weighted_sublayers(layer)
        if weighted_inside:
            reason = composite.closed_reason(layer)
            if reason is not None:
                kind = "closed"
            elif not composite.own_weights(layer):
                kind = "composite"
        return PointInfo(
            name=self.name, layer=type(layer).__name__, kind=kind, reason=reason
        )


@dataclasses.dataclass(frozen=True)
class PointInfo:
    """One scaling point of an instrumented model, as `tf_als.points` lists it.

    Attributes:
        name: the point's name, as `tf_als.scales` reports it.
        layer: the class name of the layer the point calls.
        kind: `"layer"`, a call of a layer that owns weights directly;
            `"composite"`, an opened layer without weights of its own,
            whose scale lifts everything its call computes backwards
            (its weighted sublayers are points of their own, listed after
            it); `"closed"`, a layer with weighted sublayers that could not
            be opened, so one scale serves all of its weights.
        reason: for `"closed"`, why it was not opened; else None.
    """

    name: str
    layer: str
    kind: str
    reason: Optional[str] = None


def of_plan(plan) -> tuple:
    """Every point of a Sequential or Functional model: the plan's own
    (`plan.points`), then the points inside each opened one, in point
    order."""
    found = list(plan.points)
    for point in plan.points:
        if composite.opens(point.layer):
            found += inner(point, first=len(found))
    return tuple(found)


def of_subclassed(model) -> tuple:
    """A subclassed model's points: the model itself, opened (point 0, its
    own weights and what its `call` computes outside any sublayer), then
    every weighted layer inside it."""
    root = Point(index=0, name=model.name, layer=model, kind=ROOT)
    return (root,) + tuple(inner(root, first=1))


def inner(point: Point, first: int) -> list:
    """The `"inner"` points inside opened point `point`, depth first in
    attribute order; the first gets index `first`.

    A sublayer without weights of its own but with weighted sublayers (a
    `MultiHeadAttention` inside a block) is transparent: its weighted
    sublayers belong to the nearest enclosing point and their names carry
    its name. A sublayer reachable twice (shared) is one point, named by
    its first path. An opened sublayer's own weighted sublayers are points
    inside it.
    """
    found = []
    seen = set()

    def walk(current, prefix, parent):
        for sublayer in _keras.sublayers(current, recursive=False):
            if id(sublayer) in seen or not sublayer.weights:
                continue
            seen.add(id(sublayer))
            path = f"{prefix}/{sublayer.name}"
            transparent = not composite.own_weights(sublayer)
            if transparent and composite.closed_reason(sublayer) is None:
                walk(sublayer, path, parent)
                continue
            index = first + len(found)
            found.append(
                Point(index=index, name=path, layer=sublayer, kind=INNER, parent=parent)
            )
            if composite.opens(sublayer):
                walk(sublayer, path, index)

    walk(point.layer, point.name, point.index)
    return found
