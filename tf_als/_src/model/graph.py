"""Reading a Sequential or Functional model into a flat plan of layer calls.

The plan is static, pure Python, built once by `instrument()`: which layer is
called in which order, which tensors ("slots") each call reads and writes,
who consumes each slot (that is where gradients fork), and which calls are
scaling points. Nested Sequential/Functional models are flattened into the
plan, so their layers get scaling points of their own; any other layer,
including subclassed models used as layers, is one call in the plan (which
`composite` may open). A subclassed model has no graph: its plan is
empty (`empty_plan`) and the model runs as one opened point.
"""

import dataclasses
from typing import Optional

import keras
from keras import tree

from tf_als._src.model import _keras
from tf_als._src.model import points as points_module
from tf_als._src.model._keras import Functional

# Consumer kinds: a layer call, one input position of a nested model's
# entry, a model output, and a loss a layer adds on its own outputs (activity
# regularisers), which receives its gradient directly from the loss.
CALL_INPUT = "call"
ENTER = "enter"
MODEL_OUTPUT = "output"
ADDED_LOSS = "loss"
# Call kinds.
LAYER = "layer"


@dataclasses.dataclass(frozen=True)
class Call:
    """One layer call, in execution order.

    Attributes:
        index: position in `Plan.calls`.
        kind: `"layer"` for a layer (or Keras operation) call; `"enter"` for
            the entry into a nested model, which converts the outer tensors
            to the nested model's inputs exactly as Keras does.
        operation: the layer, operation or (for `"enter"`) nested model.
        node: the call's `_keras.GraphNode`, whose arguments are
            filled in.
        scope: names of the enclosing nested models, outermost first.
        inputs: `(id(keras_tensor), slot)` for each tensor argument of the
            node, in `node.inputs` order; for `"enter"`, one
            per nested input, in the nested model's input order.
        outputs: the slot of each (flattened) output.
        training: the `training` flag an enclosing nested model's call
            recorded (the outermost that recorded one), else `None`; it
            applies only when the model is called without one, as in
            Keras (`instrument._run_call`).
        point: index of the scaling point this call is (its `Point` is
            `Plan.points[point]`), or `None`.
    """

    index: int
    kind: str
    operation: object
    node: object
    scope: tuple
    inputs: tuple
    outputs: tuple
    training: Optional[bool]
    point: Optional[int]

    @property
    def input_slots(self):
        """The distinct slots this call reads, in first-use order."""
        return tuple(dict.fromkeys(slot for _, slot in self.inputs))


@dataclasses.dataclass(frozen=True)
class Plan:
    """A model's calls, slots, forks and scaling points.

    Attributes:
        model: the model that was read.
        calls: every layer call, flattened, in execution order.
        input_slots: slots of the model's (flattened) inputs.
        output_slots: slots of the model's (flattened) outputs.
        consumers: slot -> tuple of consumers, one per distinct consumer:
            `("call", call_index)`, `("enter", call_index, position)`,
            `("output", output_index)` or `("loss", call_index)`.
        float_slots: slots whose tensors are floating point (they carry
            gradients; the others never do).
        points: a `points.Point` (kind `"call"`) per call of a layer that
            owns weights, in call order: the model's first scaling points
            (those inside opened ones follow them, `points.of_plan`). Its
            name is the layer's full path (the nested models enclosing its
            first call, outermost first, then its name), with `/call_<i>`
            appended for a layer called more than once.
    """

    model: object
    calls: tuple
    input_slots: tuple
    output_slots: tuple
    consumers: dict
    float_slots: frozenset
    points: tuple


def read(model: keras.Model) -> Plan:
    """Builds the `Plan` of a built Sequential or Functional model.

    Raises:
        TypeError: `model` is not a Keras model, or is a subclassed model.
        ValueError: `model` is not built, or calls a nested model in a way
            the plan cannot follow.
    """
    functional = functional_of(model, "model")
    _keras.recorded_training_wins()  # Read from Keras here, eagerly, once.
    builder = _Builder()
    input_slots = [builder.new_slot(x) for x in functional.inputs]
    output_slots = builder.walk(functional, input_slots, scope=(), training=None)
    return builder.finish(model, input_slots, output_slots)


def upstream_points(plan: Plan, call: Call) -> list:
    """Indices of the scaling-point calls whose outputs reach `call`'s
    inputs through weightless calls only (the points `call` passes its
    input gradient back to)."""
    producers = {slot: c.index for c in plan.calls for slot in c.outputs}
    found, stack, seen = [], list(call.input_slots), set()
    while stack:
        slot = stack.pop()
        if slot in seen:
            continue
        seen.add(slot)
        index = producers.get(slot)
        if index is None:
            continue  # A model input.
        producer = plan.calls[index]
        if producer.point is not None:
            found.append(index)
        else:
            stack.extend(producer.input_slots)
    return found


def is_flattenable(operation) -> bool:
    """True for models whose graph the plan reads instead of calling them."""
    if isinstance(operation, keras.Sequential):
        return _keras.sequential_graph(operation) is not None
    return (
        isinstance(operation, Functional)
        and type(operation).call is Functional.call
    )


def is_subclassed(model) -> bool:
    """True for a `keras.Model` with its own `call` (no layer graph to read):
    neither Sequential nor a Functional model with Keras's `call`."""
    return (
        isinstance(model, keras.Model)
        and not isinstance(model, keras.Sequential)
        and not (isinstance(model, Functional) and type(model).call is Functional.call)
    )


def empty_plan(model) -> Plan:
    """The plan of a subclassed model: no graph, so no calls; the model is
    run as one opened point (see `tf_als.instrument`)."""
    return Plan(
        model=model,
        calls=(),
        input_slots=(),
        output_slots=(),
        consumers={},
        float_slots=frozenset(),
        points=(),
    )


def functional_of(model, argument="model"):
    """The Functional graph of a built Sequential or Functional model."""
    if isinstance(model, keras.Sequential):
        if _keras.sequential_graph(model) is None:
            raise ValueError(
                f"`{argument}` is a Sequential model that is not built yet "
                f"({model.name!r}). Build it first: give it a "
                "`keras.Input(shape)` as first layer, call "
                "`model.build(input_shape)`, or call it on a batch."
            )
        return _keras.sequential_graph(model)
    if isinstance(model, Functional):
        if type(model).call is not Functional.call:
            raise TypeError(_SUBCLASSED_MESSAGE.format(argument=argument, model=model))
        return model
    if isinstance(model, keras.Model):
        raise TypeError(_SUBCLASSED_MESSAGE.format(argument=argument, model=model))
    raise TypeError(
        f"`{argument}` must be a keras.Model (Sequential or Functional); "
        f"received {type(model).__name__}: {model!r}."
    )


_SUBCLASSED_MESSAGE = (
    "`{argument}` is a subclassed model ({model.__class__.__name__} "
    "{model.name!r}), which has no layer graph to read; this needs a "
    "Sequential or Functional model."
)


class _Builder:
    def __init__(self):
        self.slot_count = 0
        self.float_slots = set()
        self.calls = []
        self.layer_calls = {}  # id(layer) -> number of calls so far

    def new_slot(self, keras_tensor):
        slot = self.slot_count
        self.slot_count += 1
        if keras.backend.is_float_dtype(keras_tensor.dtype):
            self.float_slots.add(slot)
        return slot

    def walk(self, functional, input_slots, scope, training):
        """Adds the calls of `functional`; returns its output slots."""
        slot_of = {}
        for x, slot in zip(functional.inputs, input_slots):
            slot_of[id(x)] = slot
        by_depth = _keras.nodes_by_depth(functional)
        for depth in sorted(by_depth, reverse=True):
            for node in by_depth[depth]:
                tensors = node.inputs
                if any(id(x) not in slot_of for x in tensors):
                    continue  # Not computable from the inputs; Keras skips it too.
                inputs = tuple((id(x), slot_of[id(x)]) for x in tensors)
                operation = node.operation
                if is_flattenable(operation):
                    outputs = self._walk_nested(
                        operation, node, slot_of, scope, training
                    )
                else:
                    outputs = tuple(self.new_slot(x) for x in node.outputs)
                    self.calls.append(
                        dict(
                            kind=LAYER,
                            operation=operation,
                            node=node,
                            scope=scope,
                            inputs=inputs,
                            outputs=outputs,
                            training=training,
                        )
                    )
                for x, slot in zip(node.outputs, outputs):
                    slot_of[id(x)] = slot
        return tuple(slot_of[id(x)] for x in functional.outputs)

    def _walk_nested(self, model, node, slot_of, scope, training):
        inner = functional_of(model, "nested model")
        args, kwargs = node.args, dict(node.kwargs)
        # Whose flag a nested model called `base(x, training=False)` runs
        # with is Keras's to say (`_keras.recorded_training_wins`): the
        # enclosing call's where there is one (Keras 3.15), or the one it
        # recorded (3.16; a recorded None stays None there). The other
        # counts only where that one is None.
        if "training" in kwargs:
            explicit = kwargs.pop("training")
            if _keras.recorded_training_wins():
                training = _keras.RECORDED_NONE if explicit is None else bool(explicit)
            elif training is None and explicit is not None:
                training = bool(explicit)
        kwargs.pop("mask", None)
        if len(args) != 1 or kwargs:
            raise ValueError(
                f"Nested model {model.name!r} is called with arguments "
                f"{list(kwargs) or len(args)} besides its inputs; tf_als can "
                "only flatten nested models called as `model(inputs)` or "
                "`model(inputs, training=...)`."
            )
        flat = nested_inputs(inner, args[0])
        if len(flat) != len(inner.inputs):
            raise ValueError(
                f"Nested model {model.name!r} expects {len(inner.inputs)} "
                f"inputs but is called with {len(flat)}."
            )
        entered = tuple(self.new_slot(x) for x in inner.inputs)
        self.calls.append(
            dict(
                kind=ENTER,
                operation=inner,
                node=node,
                scope=scope,
                inputs=tuple((id(x), slot_of[id(x)]) for x in flat),
                outputs=entered,
                training=training,
            )
        )
        return self.walk(inner, entered, scope + (model.name,), training)

    def finish(self, model, input_slots, output_slots):
        counts, homes = {}, {}
        for spec in self.calls:
            counts[id(spec["operation"])] = counts.get(id(spec["operation"]), 0) + 1
            homes.setdefault(id(spec["operation"]), spec["scope"])
        seen = {}
        calls, points = [], []
        consumers = {}
        for index, spec in enumerate(self.calls):
            operation = spec["operation"]
            ordinal = seen.get(id(operation), 0)
            seen[id(operation)] = ordinal + 1
            point = None
            if spec["kind"] == LAYER and _owns_weights(operation):
                point = len(points)
                # Every call of a layer is named from the same path, its
                # first call's (a tied embedding called again by an outer
                # model's head stays under its backbone's name).
                name = "/".join(homes[id(operation)] + (operation.name,))
                if counts[id(operation)] > 1:
                    name += f"/call_{ordinal}"
                points.append(
                    points_module.Point(
                        index=point, name=name, layer=operation,
                        kind=points_module.CALL, call=index,
                    )
                )
            call = Call(index=index, point=point, **spec)
            calls.append(call)
            if call.kind == ENTER:
                for position, (_, slot) in enumerate(call.inputs):
                    consumers.setdefault(slot, []).append((ENTER, index, position))
            else:
                for slot in call.input_slots:
                    consumers.setdefault(slot, []).append((CALL_INPUT, index))
                if getattr(operation, "activity_regularizer", None) is not None:
                    for slot in call.outputs:
                        consumers.setdefault(slot, []).append((ADDED_LOSS, index))
        for k, slot in enumerate(output_slots):
            consumers.setdefault(slot, []).append((MODEL_OUTPUT, k))
        return Plan(
            model=model,
            calls=tuple(calls),
            input_slots=tuple(input_slots),
            output_slots=tuple(output_slots),
            consumers={s: tuple(c) for s, c in consumers.items()},
            float_slots=frozenset(self.float_slots),
            points=tuple(points),
        )


def nested_inputs(functional, inputs):
    """Flattens what a nested Functional model is called with, in the order
    of `functional.inputs` (dicts are matched by input name, as Keras does).
    Works on KerasTensors and on real tensors alike."""
    struct = _keras.inputs_struct(functional)
    if isinstance(inputs, dict) and not isinstance(struct, dict):
        names = [x.name for x in tree.flatten(struct)]
        if set(names).issubset(inputs):
            return [inputs[name] for name in names]
    if (
        isinstance(struct, (list, tuple))
        and len(struct) == 1
        and not isinstance(inputs, (list, tuple, dict))
    ):
        return [inputs]
    return tree.flatten(inputs)


def _owns_weights(operation):
    """Scaling points are the calls of layers that own weights, frozen ones
    included: a layer unfrozen later then still has its gradients unscaled."""
    return isinstance(operation, keras.layers.Layer) and bool(operation.weights)
