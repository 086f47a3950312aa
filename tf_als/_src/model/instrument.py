"""`instrument(model)`: the same layers, with a scaling point at every call of
a layer with weights, and `scales(model)` and `points(model)` to read them."""

import keras

from tf_als._src.model import _keras
from tf_als._src.model import instrumented as instrumented_module
from tf_als._src.model.instrumented import InstrumentedModel
from tf_als._src.model.points import PointInfo

__all__ = ["InstrumentedModel", "PointInfo", "instrument", "points", "scales"]


def instrument(model: keras.Model, float32_outputs: bool = False) -> keras.Model:
    """Returns a model that shares `model`'s layers and weights and gives
    every call of a layer with weights its own adaptive loss scale.

    The returned model's forward outputs are bitwise equal to `model`'s; only
    the backward pass changes (see `backward`). Train it with a
    `tf_als.AdaptiveLossScaleOptimizer` under the `mixed_float16` policy;
    under one with no float16 compute (`float32`, `mixed_bfloat16`), it
    has no points and trains as `model` would (a warning says so).

    Args:
        model: a built `keras.Model` (Sequential, Functional or
            subclassed). Nested models, composite layers (custom layers,
            `MultiHeadAttention`, KerasHub blocks) and a subclassed model
            at the top are opened: each weighted sublayer is a point (see
            `composite`). Recurrent layers and `TimeDistributed` stay one
            point (a warning names them; `tf_als.points` says why).
        float32_outputs: bool, default False. Cast each float16 output to
            float32 for the training code (exact), so that a loss written
            by hand (a custom loop, a model's own `train_step`, a soft-Dice
            summed over a batch of maps) cannot overflow float16 (65504)
            without a non-finite value. Keras's own losses cast already;
            `predict` and `export` keep the outputs' dtypes.

    Returns:
        A new model of `model`'s own class (`isinstance` holds; its methods
        run on it as written) that is also a `tf_als.InstrumentedModel`.
        Its `layers`, `weights` and `summary` read as `model`'s;
        `uninstrumented()` returns `model`. A compiled `model` comes
        compiled the same way, its optimizer an `AdaptiveLossScaleOptimizer`
        (a `LossScaleOptimizer`'s inner optimizer and knobs carried over).

    Raises:
        TypeError: `model` is not a `keras.Model`.
        ValueError: `model` is already instrumented, not built, has no
            layer with weights, or uses something tf_als cannot scale (the
            message says what and what to do).

    Example:

    ```python
    keras.mixed_precision.set_global_policy("mixed_float16")
    inputs = keras.Input((64,))
    x = keras.layers.Dense(128, activation="relu")(inputs)
    outputs = keras.layers.Dense(10, dtype="float32")(x)
    model = tf_als.instrument(keras.Model(inputs, outputs))
    model.compile(
        optimizer=tf_als.AdaptiveLossScaleOptimizer(keras.optimizers.Adam()),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    ```
    """
    instrumented = instrumented_module.make(model, float32_outputs=float32_outputs)
    arguments = _keras.compile_arguments(model)
    if arguments is not None:
        arguments["optimizer"] = instrumented_module.adaptive(model.optimizer)
        # Keras's compile only: what a class's own `compile` did besides
        # (a GAN's optimizers, a task's sampler) is in the copied state.
        InstrumentedModel.compile(instrumented, **arguments)
    return instrumented


def scales(model: keras.Model) -> dict[str, float]:
    """The current per-layer scale of every scaling point of an instrumented
    model, as `{point name: float}` in execution order.

    Point names are the layer's full path: its name, prefixed by the
    names of the nested models around its first call (`"encoder/dense"`),
    with `"/call_<i>"` appended for a layer called more than once (every
    call from that same path: a tied embedding that a task's head calls
    again is `"backbone/token_embedding/call_1"`).

    Raises:
        TypeError: `model` was not returned by `tf_als.instrument`.
    """
    _require_instrumented(model, "tf_als.scales()")
    state = model.scaling_state
    values = keras.ops.convert_to_numpy(state.scales)
    return {name: float(v) for name, v in zip(state.point_names, values)}


def points(model: keras.Model) -> list[PointInfo]:
    """Every scaling point of an instrumented model, in the order of
    `tf_als.scales`, with the composite layers that stayed closed and why.

    Raises:
        TypeError: `model` was not returned by `tf_als.instrument`.

    Example:

    ```python
    for point in tf_als.points(model):
        print(point.name, point.kind, point.reason or "")
    # encoder/attention        composite
    # encoder/attention/query  layer
    # ...
    ```
    """
    _require_instrumented(model, "tf_als.points()")
    return list(model.point_infos)


def _require_instrumented(model, what):
    if not isinstance(model, InstrumentedModel):
        raise TypeError(
            f"{what} needs a model returned by tf_als.instrument(); "
            f"received {type(model).__name__} "
            f"{getattr(model, 'name', model)!r}. Instrument it first: "
            "`model = tf_als.instrument(model)`."
        )
