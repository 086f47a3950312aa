"""`ScaleHistory`: what the scaler did, per scaling point, for `fit` and
custom loops, as Python data, Keras logs and TensorBoard summaries; and
`NonFiniteGuard` (defined in `storm`), which stops a run whose steps
are all skipped.

It only reads: the scaling points' variables (the scales written by the
optimizer's `apply` on every step, the records every `telemetry_interval`
steps) and the optimizer's counters.
"""

import functools
import os
from typing import Optional

import keras

from tf_als._src.model.instrument import InstrumentedModel
from tf_als._src.training.optimizer import AdaptiveLossScaleOptimizer
from tf_als._src.monitoring import overview
from tf_als._src.monitoring import summaries
from tf_als._src.monitoring.summaries import (  # noqa: F401  (documented names)
    OVERVIEW_IMAGE_DESCRIPTION,
    OVERVIEW_IMAGE_TAG,
    OVERVIEW_SCALARS,
    OVERVIEW_TEXT_TAG,
    OVERVIEW_UPDATES,
    POINT_NAMES_TAG,
    PROMOTIONS_TAG,
    RUN_NAME,
    tag_group,
)
from tf_als._src.failures import promote
from tf_als._src.failures import storm

NonFiniteGuard = storm.NonFiniteGuard  # Defined with the error it raises.

POINT_QUANTITIES = summaries.POINT_QUANTITIES
"""Per point and update: the per-layer scale, the cumulative scale, the
`tallies.GradientStatistics` of the incoming gradient, and the forward
headroom of the point's float16 output (`state.FORWARD_FIELDS`)."""

EPOCH_LOG_KEYS = ("loss_scale", "skipped_steps", "worst_subnormal_fraction")
"""What `ScaleHistory` adds to Keras's epoch logs."""

def _forwarded(method):
    """A `ScaleHistory` hook that, when it records several models, runs on
    each model's own `ScaleHistory` instead."""

    @functools.wraps(method)
    def forward(self, *args, **kwargs):
        if not self._children:
            return method(self, *args, **kwargs)
        for child in self._children:
            getattr(child, method.__name__)(*args, **kwargs)
        return None

    return forward


class ScaleHistory(keras.callbacks.Callback):
    """Records every telemetry step, and optionally writes it to
    TensorBoard.

    At every telemetry step (each `telemetry_interval` steps of the
    optimizer, and again when such a step was skipped for non-finite
    gradients and is retried) it records, per scaling point,
    `POINT_QUANTITIES`: the per-layer scale (the scales follow the gradient
    on every step; this is the latest one chosen), the cumulative scale
    T_in, the percentile and amax of the incoming gradient, and the
    fractions of its elements that are exactly zero, float16 subnormal, or
    within a factor 2 of float16's maximum (amax exact, the rest estimated
    from a sample of the gradient); the forward headroom of the point's
    float16 output, `forward_amax` and `forward_near_max_fraction` (the
    share of its elements within `rule.NEAR_MAX_FACTOR` of float16's
    maximum; both exact, 0 for a layer computing in float32); plus the
    global loss scale and the number of skipped steps so far.

    `history` holds it as plain Python data:

        {"step": [optimizer step of each update],
         "loss_scale": [...], "skipped_steps": [...],
         "points": {point name: {quantity: [...], "histogram": [[...]]}},
         "promotions": [{"layer": ..., "reason": ..., "step": ...}]}

    (`promotions`: layers `promote_on_storm` switched to float32.)

    At the end of each epoch it adds `EPOCH_LOG_KEYS` to Keras's logs, so
    `History`, `CSVLogger` (listed after this callback) and the progress
    bar show them: the global loss scale, skipped steps so far, and
    `worst_subnormal_fraction`, the largest share, over the points at the
    last update, of incoming gradient elements still float16-subnormal
    after the point's scale (exact zeros from ReLU, padding or pooling are
    not counted; a few percent is noise, a share that grows across epochs
    is underflow coming).

    With `log_dir`, an overview whose size does not depend on the model
    (`overview/...`: the two `OVERVIEW_SCALARS`, a heat-map image of log2
    scales, layers by updates, and a text naming the worst layers), and per
    layer the same records as TensorBoard scalars in the run
    `<log_dir>/tf_als`, tags `<layer>/<quantity>` (one fold per layer; `/`
    in point names becomes `.`) and `global/loss_scale`,
    `global/skipped_steps`, texts `global/point_names` (the points' names
    in execution order) and `global/promotions`, and a histogram `<layer>/log2_magnitude` of the
    incoming gradient's log2 magnitudes (buckets [e, e+1) for the float16
    exponents e; zeros are counted in `zero_fraction`). The writer opens at
    the first write. `keras.callbacks.TensorBoard` may use the same
    `log_dir`: it writes the runs `train` and `validation`.

    Several models: `fit` on a model that is not instrumented itself but
    holds instrumented models among its layers (keras.io's GANs: its
    generator and discriminator), or `models=[...]`, records each model
    apart, with the optimizer that applies its gradients: `history` is
    then `{model name: the structure above}`, the epoch logs are prefixed
    `<model name>_`, and the summaries go to `<log_dir>/<model name>`.

    Args:
        log_dir: str or None, where to write TensorBoard summaries.
        histograms: bool, default True. Also write the log2 histograms.
        models: optional; the instrumented models to record (a list),
            instead of the fitted model or those it holds.

    Example:

    ```python
    history = tf_als.callbacks.ScaleHistory(log_dir="logs")
    model.fit(x, y, epochs=5, callbacks=[history,
                                         keras.callbacks.TensorBoard("logs")])
    history.history["points"]["dense"]["scale"]   # [8.0, 8.0, 16.0, ...]
    ```

    In a custom loop, call `callback.set_model(model)` once (with several
    optimizers, `set_model(model, optimizer=g_optimizer)` says whose steps
    count) and `callback.record_step(steps=1)` after each step.
    """

    def __init__(
        self, log_dir: Optional[str] = None, histograms: bool = True, models=None
    ):
        super().__init__()
        self._models = None if models is None else _checked_models(models)
        self._children = []  # One ScaleHistory per model, when several.
        self._prefix = ""  # A child's: its model's name, for the epoch logs.
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(
                "`log_dir` must be a path (str) or None; received "
                f"{log_dir!r}."
            )
        if not isinstance(histograms, bool):
            raise TypeError(
                f"`histograms` must be True or False; received {histograms!r}."
            )
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.histograms = histograms
        self._summaries = None
        if self.log_dir is not None:
            self._summaries = summaries.Summaries(self.log_dir, histograms)
        self._given_optimizer = None
        self._reset()

    # -- state ----------------------------------------------------------

    def _reset(self):
        self.history = {
            "step": [],
            "loss_scale": [],
            "skipped_steps": [],
            "points": {},
            "promotions": [],
        }
        self.skipped_steps = 0
        self._last_seen = None
        self._iterations_before = None
        self._batch_before = None

    def set_model(self, model, optimizer=None):
        """Records `model` (fit calls this). `optimizer`: the
        `AdaptiveLossScaleOptimizer` whose steps to count, when it is not
        `model.optimizer` and more than one optimizer applies the model's
        gradients; by default the one that does."""
        if optimizer is not None and not isinstance(
            optimizer, AdaptiveLossScaleOptimizer
        ):
            raise TypeError(
                "`optimizer` must be a tf_als.AdaptiveLossScaleOptimizer or "
                f"None; received {optimizer!r}."
            )
        self._given_optimizer = optimizer
        targets = self._models or _instrumented_models(model)
        if len(targets) > 1:
            super().set_model(model)
            self._children = [self._child(m) for m in targets]
            self.history = {m.name: c.history for m, c in zip(targets, self._children)}
            return
        model = targets[0]
        super().set_model(model)
        self.history["points"] = {
            p.point_name: {q: [] for q in POINT_QUANTITIES + ("histogram",)}
            for p in model.scaling_points
        }

    @property
    def _optimizer(self):
        if self._given_optimizer is not None:
            return self._given_optimizer
        optimizer = getattr(self.model, "optimizer", None)
        if isinstance(optimizer, AdaptiveLossScaleOptimizer):
            return optimizer
        trainers = self.model.trained_by()
        if len(trainers) == 1:
            return trainers[0]
        if not trainers:
            raise ValueError(
                f"Model {self.model.name!r} has no "
                "tf_als.AdaptiveLossScaleOptimizer yet: compile it with one, "
                "or, in a custom loop, apply a step with one before "
                "record_step."
            )
        names = ", ".join(repr(o.name) for o in trainers)
        raise ValueError(
            f"Several optimizers apply the gradients of model "
            f"{self.model.name!r} ({names}); say which one's steps to "
            "record: `set_model(model, optimizer=...)`."
        )

    # -- Keras hooks -------------------------------------------------------

    @_forwarded
    def on_train_begin(self, logs=None):
        if self._summaries is not None:
            self._summaries.reset()

    @_forwarded
    def on_train_batch_begin(self, batch, logs=None):
        # Before its first step a model held by another (a GAN's) may have
        # no optimizer to read yet; the batch's end finds it.
        found = self.model.trained_by() or [getattr(self.model, "optimizer", None)]
        if self._given_optimizer is not None or found[0] is not None:
            self._iterations_before = _read_int(self._optimizer.iterations)
        self._batch_before = batch

    @_forwarded
    def on_train_batch_end(self, batch, logs=None):
        steps = 1
        if self._batch_before is not None:
            steps = batch - self._batch_before + 1
        self._observe(steps)

    @_forwarded
    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        optimizer, key = self._optimizer, self._prefix
        logs[key + "loss_scale"] = float(_read_float(optimizer.dynamic_scale))
        logs[key + "skipped_steps"] = self.skipped_steps
        worst = overview.worst(self._subnormal_after_scale(), count=1)
        logs[key + "worst_subnormal_fraction"] = worst[0][1] if worst else 0.0

    def _child(self, model):
        """The ScaleHistory of `model`, one of several recorded: its logs
        prefixed with its name, its summaries under `<log_dir>/<name>`."""
        log_dir = None if self.log_dir is None else os.path.join(self.log_dir, model.name)
        child = ScaleHistory(log_dir, self.histograms)
        child._prefix = f"{model.name}_"
        child.set_model(model)
        return child

    def _subnormal_after_scale(self) -> dict:
        """{point name: `overview.subnormal_after_scale`} at the last update."""
        return {
            name: overview.subnormal_after_scale(
                values["histogram"][-1], values["scale"][-1]
            )
            for name, values in self.history["points"].items()
            if values["histogram"]
        }

    @_forwarded
    def on_train_end(self, logs=None):
        self._note_promotions()
        if self._summaries is not None:
            self._summaries.flush()

    # -- custom loops ------------------------------------------------------

    @_forwarded
    def record_step(self, steps: int = 1):
        """For custom training loops: call after each `optimizer.apply`
        (after `set_model(model)` once). `steps` is how many optimizer steps
        ran since the last call."""
        if self.model is None:
            raise ValueError(
                "Call `set_model(model)` before `record_step()` (fit does "
                "this itself)."
            )
        self._observe(steps)

    # -- recording ---------------------------------------------------------

    def _observe(self, steps):
        """After `steps` optimizer steps: count skipped steps, and record
        the scaling points if an update happened during them (each update
        writes its step into `last_update`, a retried one the same step)."""
        optimizer = self._optimizer
        iterations = _read_int(optimizer.iterations)
        before = self._iterations_before
        if before is not None:
            self.skipped_steps += max(steps - (iterations - before), 0)
        self._iterations_before = iterations
        self._batch_before = None
        if not self.model.point_records:  # It computes nothing in float16.
            return
        last = _read_int(self.model.scaling_state.last_updates[0])
        if before is None:
            happened = last >= 0 and last != self._last_seen
        else:
            happened = last >= before
        if happened:
            self._last_seen = last
            self._record(last, optimizer)
        self._note_promotions()

    def _note_promotions(self):
        """Adds the layers promoted to float32 since the last call to
        `history["promotions"]` (and TensorBoard)."""
        recorded = self.history["promotions"]
        for promotion in promote.promoted(self.model)[len(recorded):]:
            recorded.append(promotion.as_dict())
            if self._summaries is not None:
                self._summaries.promotion(promotion, list(self.history["points"]))

    def _record(self, step, optimizer):
        loss_scale = float(_read_float(optimizer.dynamic_scale))
        self.history["step"].append(step)
        self.history["loss_scale"].append(loss_scale)
        self.history["skipped_steps"].append(self.skipped_steps)
        rows = []
        scaling_state = self.model.scaling_state
        read = zip(scaling_state.point_names, scaling_state.read())
        for point, (values, histogram) in read:
            target = self.history["points"][point]
            for quantity in POINT_QUANTITIES:
                target[quantity].append(values[quantity])
            target["histogram"].append([float(v) for v in histogram])
            rows.append((point, values, histogram))
        if self._summaries is not None:
            self._summaries.update(step, self.history, rows, self._subnormal_after_scale())


def _instrumented_models(model) -> list:
    """What `ScaleHistory` records for a fitted `model` given no `models`:
    the model, if instrumented; else the instrumented models among its
    layers (a GAN's generator and discriminator)."""
    if isinstance(model, InstrumentedModel):
        return [model]
    held = [m for m in getattr(model, "layers", []) if isinstance(m, InstrumentedModel)]
    if held:
        return held
    raise TypeError(
        "ScaleHistory records models returned by tf_als.instrument(); "
        f"received {type(model).__name__} {getattr(model, 'name', model)!r}, "
        "which is not one and holds none among its layers. Pass them: "
        "`ScaleHistory(models=[generator, discriminator])`, or, in a custom "
        "loop, `set_model(instrumented_model)`."
    )


def _checked_models(models) -> list:
    """`models` as a non-empty list of instrumented models."""
    if not isinstance(models, (list, tuple)) or not models:
        raise TypeError(
            "`models` must be a non-empty list of models returned by "
            f"tf_als.instrument(), or None; received {models!r}."
        )
    for model in models:
        if not isinstance(model, InstrumentedModel):
            raise TypeError(
                "`models` must hold models returned by tf_als.instrument(); "
                f"received {type(model).__name__} {getattr(model, 'name', model)!r} "
                "(instrument it: `tf_als.instrument(model)`)."
            )
    return list(models)


def _read_int(variable):
    """A scalar variable (or tensor) as int. Its own `numpy()` takes half
    the time of `keras.ops.convert_to_numpy` (about 70 against 130
    microseconds on this project's CPU), and this runs after every batch;
    `int(variable)` would be faster still but fails on a variable a
    distribution strategy syncs on read."""
    return int(variable.numpy())


def _read_float(variable):
    return float(variable.numpy())
