"""What `tf_als.instrument` refuses, and what it warns about: a model it
cannot scale is named with what to do instead."""

import warnings

from tf_als._src.model import _keras
from tf_als._src.model import graph
from tf_als._src.model import points as points_module


def points_of(model, instrumented_type) -> tuple:
    """(the plan, every `points.Point`) of `model`, checked: raises when it
    holds an instrumented model (an `instrumented_type`) or something
    tf_als cannot scale. A model that computes nothing in float16 has no
    points (`warn_no_float16` says so)."""
    if graph.is_subclassed(model):
        _check_subclassed(model, instrumented_type)
        plan = graph.empty_plan(model)
        layers = [model] + _keras.sublayers(model, recursive=True)
        float16 = any(layer.weights and _float16(layer) for layer in layers)
        records = points_module.of_subclassed(model) if float16 else []
    else:
        plan = graph.read(model)
        _check_plan(plan, instrumented_type)
        float16 = any(
            call.kind == graph.LAYER and _float16(call.operation) for call in plan.calls
        )
        records = points_module.of_plan(plan) if float16 else []
    if not float16:
        warn_no_float16(model)
    _check_inner(records)
    return plan, records


def warn_no_float16(model) -> None:
    """Says that `model`, which computes nothing in float16, gets no
    scaling points and trains as it would without tf_als; under a float32
    policy, also how to train in float16 (and why the policy may have been
    reset)."""
    policy = model.dtype_policy.name
    message = _NO_FLOAT16.format(name=model.name, policy=policy)
    if "bfloat16" not in policy:
        message += _TO_TRAIN_IN_FLOAT16
    warnings.warn(message, stacklevel=5)


def _float16(layer) -> bool:
    return getattr(layer, "compute_dtype", None) == "float16"


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
    "Model {name!r} computes nothing in float16 (its policy is {policy!r}): "
    "float32 and bfloat16 gradients do not underflow, so tf_als adds no "
    "scaling points and the model trains exactly as it would without "
    "tf_als (an AdaptiveLossScaleOptimizer given to it is Keras's "
    "LossScaleOptimizer; a plain optimizer stays plain)."
)
_TO_TRAIN_IN_FLOAT16 = (
    " To train in float16, call "
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
    for layer in _keras.sublayers(model, recursive=True):
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
    for call in plan.calls:
        layer = call.operation
        if isinstance(layer, instrumented_type):
            raise ValueError(_INSTRUMENTED_INSIDE.format(name=name, layer=layer.name))
        if call.point is not None and getattr(layer, "activity_regularizer", None):
            raise ValueError(_ACTIVITY_REGULARIZER.format(name=layer.name))
