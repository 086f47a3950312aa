"""Warnings for float16 failures that produce no non-finite value.

A failure that makes something inf or NaN skips a step, and tf_als reacts
(the global scale backs off; a storm promotes the layer). Two failures
skip nothing, so nothing reacts unless they are looked for:

- **An output near float16's maximum.** A scaling point whose float16
  forward output reaches 65504 / `rule.NEAR_MAX_FACTOR` is a factor
  from overflowing, and a float16 sum or mean over it may already be inf.
  Read from the forward headroom the telemetry records
  (`forward_amax`, `state.RECORD_FIELDS`).
- **Every gradient exactly zero.** When every point's incoming gradient has
  been exactly zero for `ZERO_GRADIENT_STEPS` steps in a row
  (`zero_gradient_steps` in the state), the loss is a constant: typically a
  sum over float16 outputs that overflowed (x / inf = 0).

`warn_silent_failures(model)` warns about each once per model (a point
once, whatever its later records say), naming the layer and the fix. It
is meant to run after every batch: it reads one scalar and the `[points]`
steps of the last telemetry record, and the records only when a new
telemetry step was written.

Example:

```python
for x, y in dataset:
    train_step(x, y)                   # optimizer.apply(...)
    tf_als.silent.warn_silent_failures(model)
```
"""

import warnings

import keras
import numpy as np

from tf_als._src.failures import nonfinite
from tf_als._src.scaling import rule
from tf_als._src.training import state as state_module

ZERO_GRADIENT_STEPS = 5
"""How many steps in a row with every incoming gradient exactly zero make
the zero-gradient warning (fewer could be a flat stretch of a real loss)."""

_FORWARD_AMAX = state_module.RECORD_FIELDS.index("forward_amax")
_FORWARD_NEAR_MAX = state_module.RECORD_FIELDS.index("forward_near_max_fraction")


class SilentFailureWarning(UserWarning):
    """A float16 failure that skips no step: an output near float16's
    maximum, or gradients that are all exactly zero."""


class _Watch:
    """What `warn_silent_failures` saw and warned about, for one model."""

    def __init__(self):
        self.last_updates = None  # the `last_updates` last read
        self.warned_points = set()
        self.warned_zero = False


def warn_silent_failures(model, stacklevel: int = 2) -> list:
    """Warns (`SilentFailureWarning`) about the silent failures `model`'s
    state shows, each once per model, and returns the messages of this
    call's warnings (usually none).

    Args:
        model: a model returned by `tf_als.instrument`, after an
            `AdaptiveLossScaleOptimizer` applied its gradients.
        stacklevel: int, default 2 (the caller), passed to
            `warnings.warn`.

    Returns:
        A list of str.

    Raises:
        TypeError: `model` was not instrumented.
    """
    if getattr(model, "scaling_state", None) is None:
        raise TypeError(
            "tf_als.silent.warn_silent_failures() needs a model returned by "
            f"tf_als.instrument(); received {type(model).__name__} "
            f"{getattr(model, 'name', model)!r}. Instrument it first: "
            "`model = tf_als.instrument(model)`."
        )
    watch = _watch(model)
    messages = _zero_gradients(model, watch) + _near_max(model, watch)
    for message in messages:
        warnings.warn(message, SilentFailureWarning, stacklevel=stacklevel + 1)
    return messages


def _watch(model) -> _Watch:
    """The model's `_Watch`, kept on the model object (made on first use)."""
    watch = getattr(model, "_silent_watch", None)
    if watch is None:
        watch = _Watch()
        model._silent_watch = watch
    return watch


def _zero_gradients(model, watch) -> list:
    """The zero-gradient message, once, when the count reaches
    `ZERO_GRADIENT_STEPS`."""
    if watch.warned_zero:
        return []
    steps = int(model.scaling_state.zero_gradient_steps.numpy())
    if steps < ZERO_GRADIENT_STEPS:
        return []
    watch.warned_zero = True
    return [zero_gradient_message(model.name, steps)]


def zero_gradient_message(model_name: str, steps: int) -> str:
    """What the zero-gradient warning says.

    >>> print(zero_gradient_message("unet", 5).split(":")[1])
     every gradient in model 'unet' has been exactly zero for 5 steps in a row
    """
    return (
        f"tf_als: every gradient in model {model_name!r} has been exactly "
        f"zero for {steps} steps in a row: the loss is finite and no step "
        "is skipped, but nothing trains. This is usually a float16 "
        "overflow in the loss or an output: a sum over float16 outputs "
        "that reached inf makes the loss a constant (x / inf = 0), whose "
        "gradient is zero everywhere. Fixes: compute the loss in float32 "
        '(`y_pred = tf.cast(y_pred, "float32")` before any sum); give the '
        'output layer dtype="float32"; or instrument with '
        "`tf_als.instrument(model, float32_outputs=True)`. (If the loss is "
        "truly flat, such as a hinge loss whose margins all hold, ignore "
        "this.)"
    )


def _near_max(model, watch) -> list:
    """A message per point not warned about yet whose latest record's
    forward amax is within `NEAR_MAX_FACTOR` of float16's maximum; the
    records are read only when a telemetry step wrote new ones."""
    state, points = model.scaling_state, model.point_records
    if len(watch.warned_points) == len(points):
        return []
    last = state.last_updates.numpy()
    if watch.last_updates is not None and np.array_equal(last, watch.last_updates):
        return []
    watch.last_updates = last
    records = keras.ops.convert_to_numpy(state.records)
    near = (records[:, _FORWARD_AMAX] >= rule.NEAR_MAX_THRESHOLD) & (last >= 0)
    messages = []
    for i in np.flatnonzero(near):
        name, layer = points[i].name, points[i].layer
        if name in watch.warned_points:
            continue
        watch.warned_points.add(name)
        messages.append(
            near_max_message(
                name, nonfinite.layer_path(layer), type(layer).__name__,
                float(records[i, _FORWARD_AMAX]),
                float(records[i, _FORWARD_NEAR_MAX]), int(last[i]),
            )
        )
    return messages


def near_max_message(point, path, layer_class, amax, share, step) -> str:
    """What the near-maximum warning says about one scaling point.

    >>> print(near_max_message("head", "head", "Dense", 8000.0, 1.0, 3)[:78])
    tf_als: layer 'head' (Dense, scaling point 'head') computes in float16 and its
    """
    return (
        f"tf_als: layer {path!r} ({layer_class}, scaling point {point!r}) "
        f"computes in float16 and its output reached {amax:g} at step "
        f"{step} ({share:.2%} of its elements at or above "
        f"{rule.NEAR_MAX_THRESHOLD:g}), within a factor "
        f"{rule.NEAR_MAX_FACTOR} of float16's maximum, 65504. Nothing is "
        "skipped yet, but a little growth overflows it to inf, and a "
        "float16 sum or mean over it may already be inf. Give layer "
        f'{path!r} dtype="float32" where the model is built (for example '
        f'`keras.layers.{layer_class}(..., dtype="float32")`).'
    )
