"""`AdaptiveLossScaleOptimizer`'s arguments, checked, and the check that a
model's backward pass was built with the optimizer's knobs.

Every check raises `ValueError` (`TypeError` for an inner optimizer that
is not one) naming the argument and the value received, as Keras's
`LossScaleOptimizer` does for its own; the per-layer knobs are checked by
`scaling.config.ScalingConfig`.
"""

import difflib
import inspect
import math
import numbers
import warnings

import keras

from tf_als._src.scaling import config as config_module

DEFAULT_INTERVAL = 100

# Keyword arguments Keras's LossScaleOptimizer takes besides its named ones
# (`dynamic`, and base optimizer defaults that old configs carry); it
# checks their values itself.
PARENT_KEYWORDS = (
    "dynamic",
    "weight_decay",
    "clipnorm",
    "global_clipnorm",
    "clipvalue",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)


def check_keywords(kwargs, init) -> None:
    """Raises naming every key of `kwargs` that is neither a parameter of
    `init` nor one of `PARENT_KEYWORDS`, with the closest parameter of
    each when there is one.

    >>> def init(self, inner_optimizer, update_interval=100, **kwargs): ...
    >>> check_keywords({"update_intervall": 1, "foo": 2}, init)
    Traceback (most recent call last):
    ...
    ValueError: AdaptiveLossScaleOptimizer got unexpected keyword arguments: `update_intervall`, `foo`. Did you mean `update_interval` for `update_intervall`? Its arguments: inner_optimizer, update_interval.
    """
    named = [p for p in inspect.signature(init).parameters if p not in ("self", "kwargs")]
    unknown = [key for key in kwargs if key not in PARENT_KEYWORDS]
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, named + list(PARENT_KEYWORDS), n=1)
        if close:
            hints.append(f"`{close[0]}`" + (f" for `{key}`" if len(unknown) > 1 else ""))
    listed = ", ".join(f"`{key}`" for key in unknown)
    # ValueError, as Keras's LossScaleOptimizer raises for these.
    raise ValueError(
        "AdaptiveLossScaleOptimizer got "
        + (f"an unexpected keyword argument {listed}." if len(unknown) == 1
           else f"unexpected keyword arguments: {listed}.")
        + (f" Did you mean {', '.join(hints)}?" if hints else "")
        + f" Its arguments: {', '.join(named)}."
    )


def check_inner_optimizer(inner_optimizer) -> None:
    """Raises unless `inner_optimizer` is a Keras optimizer that does not
    scale the loss itself."""
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` is already a loss scale optimizer "
            f"({type(inner_optimizer).__name__}); loss scaling would be "
            "applied twice. Pass the optimizer it wraps, e.g. "
            "`AdaptiveLossScaleOptimizer(keras.optimizers.Adam())`."
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`inner_optimizer` must be a keras.optimizers.Optimizer instance "
            f"(e.g. keras.optimizers.Adam()); received {inner_optimizer!r}."
        )


def check_positive_number(name, value) -> None:
    """Raises unless `value` is a positive finite real number."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"`{name}` must be a positive finite number; received {value!r}."
        )


def check_skip_knobs(max_consecutive_skips, promote_on_storm) -> None:
    """Raises unless `max_consecutive_skips` is an int >= 1 or None and
    `promote_on_storm` a bool."""
    if not isinstance(promote_on_storm, bool):
        raise ValueError(
            f"`promote_on_storm` must be True or False; received {promote_on_storm!r}."
        )
    if max_consecutive_skips is not None:
        config_module.check_int(
            "max_consecutive_skips", max_consecutive_skips, none_allowed=True
        )


def telemetry_interval(rule, update_interval, telemetry_interval) -> int:
    """The telemetry interval to use. Until 0.3, `update_interval` also set
    how often the statistics were recorded; a config that sets it without
    `telemetry_interval` (an old one, or old code) keeps that cadence for
    the telemetry, with a warning when the default rule makes it moot."""
    if telemetry_interval is not None:
        return telemetry_interval
    if update_interval != DEFAULT_INTERVAL and rule == "amax":
        warnings.warn(
            f"`update_interval={update_interval!r}`: since tf_als 0.3 the "
            "per-layer scales follow the gradient on every step, and "
            "`update_interval` only sets how often the paper's rule "
            "(`rule='paper'`) updates them. It now sets "
            "`telemetry_interval`, how often the statistics are recorded; "
            "pass `telemetry_interval` instead.",
            DeprecationWarning,
            stacklevel=4,
        )
        return update_interval
    return DEFAULT_INTERVAL


def check_same_knobs(optimizer, model) -> None:
    """Raises when `model`'s backward pass chooses its scales with other
    knobs than `optimizer`'s (it was traced, or ran, before they met: a
    custom loop whose model was not compiled with the optimizer; or a
    second instrumentation of the same layers, which `owners` finds by
    their variables, never compiled with it)."""
    mine = config_module.backward_fields(optimizer.scaling_config)
    theirs = config_module.backward_fields(model.scaling_config)
    if mine == theirs:
        return
    raise ValueError(
        f"AdaptiveLossScaleOptimizer {optimizer.name!r} applies gradients of "
        f"model {model.name!r}, whose backward pass chose its scales "
        f"with {_knobs(model.scaling_config)}, not this optimizer's "
        f"{_knobs(optimizer.scaling_config)}: the pass is built before the "
        "optimizer applies it. Compile the model with the optimizer "
        "before its first step: `model.compile(optimizer=optimizer)` "
        "(in a custom loop too). If it is a second `tf_als.instrument` "
        "of the layers this optimizer trains, it shares their variables "
        "and the optimizer finds it too: compile it with an optimizer of "
        "the same knobs."
    )


def _knobs(config) -> str:
    fields = ("rule", "max_layer_scale", "overflow_margin")
    if config.rule == "paper":
        fields += ("underflow_rate",)
    return ", ".join(f"{f}={getattr(config, f)!r}" for f in fields)
