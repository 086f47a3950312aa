"""What `tf_als.instrument` refuses, and what it warns about: a model it
cannot scale is named with what to do instead."""

import warnings

from tf_als._src.model import _keras
from tf_als._src.model import graph
from tf_als._src.model import points as points_module


def points_of(model, instrumented_type) -> tuple:
    """(the plan, every `points.Point`) of `model`, checked: raises when it
    holds an instrumented model (an `instrumented_type`) or something
    tf_als cannot scale."""
    if graph.is_subclassed(model):
        _check_subclassed(model, instrumented_type)
        plan, records = graph.empty_plan(model), points_module.of_subclassed(model)
    else:
        plan = graph.read(model)
        _check_plan(plan, instrumented_type)
        records = points_module.of_plan(plan)
    _check_inner(records)
    return plan, records


def warn_closed(model, infos) -> None:
    """Warns about the composite layers among `infos` (`PointInfo`s of
    `model`'s points) that stay one scaling point each."""
    closed = [p for p in infos if p.kind == "closed"]
    if closed:
        listing = "; ".join(f"{p.name!r} ({p.layer}): {p.reason}" for p in closed)
        warnings.warn(
            f"tf_als.instrument({model.name!r}): {len(closed)} "
            f"layer(s) with weighted sublayers stay one scaling point each, "
            f"so one scale serves all of their weights: {listing}. "
            "tf_als.points(model) lists every point.",
            stacklevel=4,
        )


_NO_FLOAT16 = (
    "Model {name!r} computes nothing in float16 (its layers' policy is "
    "{policy!r}); float32 and bfloat16 gradients do not underflow, so loss "
    "scaling is unnecessary. To train in float16, call "
    "`keras.mixed_precision.set_global_policy('mixed_float16')` before "
    "building the model. Where something resets the policy before the "
    "model is built (KerasTuner clears the session, and with it the "
    "policy, before every trial), set it there: in a KerasTuner "
    "`HyperModel`, first thing in `build`."
)
_INSTRUMENTED_INSIDE = (
    "Model {name!r} contains the instrumented model {layer!r} as a layer; "
    "its gradients would be scaled twice. Build the outer model from the "
    "original model (`{layer}.uninstrumented()`) and instrument the outer "
    "one."
)
_ACTIVITY_REGULARIZER = (
    "Layer {name!r} has weights and an activity regularizer; tf_als cannot "
    "route the regularizer's gradient through the layer's scaling point. "
    "Move the regularizer into a `keras.layers.ActivityRegularization` "
    "layer after it."
)


def _check_subclassed(model, instrumented_type):
    name = model.name
    if not model.built or not model.weights:
        raise ValueError(
            f"Subclassed model {name!r} has no weights yet; "
            "tf_als.instrument() needs a built model. Call it on a batch "
            "first (`model(x)`), or build it (`model.build(input_shape)`)."
        )
    layers = [model] + _keras.sublayers(model, recursive=True)
    if not any(
        layer.weights and getattr(layer, "compute_dtype", None) == "float16"
        for layer in layers
    ):
        raise ValueError(_NO_FLOAT16.format(name=name, policy=model.dtype_policy.name))
    for layer in layers[1:]:
        if isinstance(layer, instrumented_type):
            raise ValueError(_INSTRUMENTED_INSIDE.format(name=name, layer=layer.name))


def _check_inner(records):
    """Refuses an inner point whose layer has an activity regularizer (the
    plan's calls are checked by `_check_plan`)."""
    for point in records:
        if point.kind == points_module.CALL:
            continue
        if getattr(point.layer, "activity_regularizer", None) is not None:
            raise ValueError(_ACTIVITY_REGULARIZER.format(name=point.name))


def _check_plan(plan, instrumented_type):
    name = plan.model.name
    if not plan.points:
        raise ValueError(
            f"Model {name!r} has no layer with weights, so there is nothing "
            "to scale or train; tf_als.instrument() needs a model with "
            "trainable layers."
        )
    if not any(
        call.kind == graph.LAYER
        and getattr(call.operation, "compute_dtype", None) == "float16"
        for call in plan.calls
    ):
        raise ValueError(
            _NO_FLOAT16.format(name=name, policy=plan.model.dtype_policy.name)
        )
    for call in plan.calls:
        layer = call.operation
        if isinstance(layer, instrumented_type):
            raise ValueError(_INSTRUMENTED_INSIDE.format(name=name, layer=layer.name))
        if call.point is not None and getattr(layer, "activity_regularizer", None):
            raise ValueError(_ACTIVITY_REGULARIZER.format(name=layer.name))
