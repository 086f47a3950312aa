"""`ScaleHistory`: what the scaler did, per scaling point, for `fit` and
custom loops, as Python data, Keras logs and TensorBoard summaries; and
`NonFiniteGuard` (defined in `storm`), which stops a run whose steps
are all skipped.

It only reads: the scaling points' variables (the scales written by the
optimizer's `apply` on every step, the records every `telemetry_interval`
steps) and the optimizer's counters.
"""

import os
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from tf_als._src.model.instrument import InstrumentedModel
from tf_als._src.training.optimizer import AdaptiveLossScaleOptimizer
from tf_als._src.monitoring import overview
from tf_als._src.failures import promote
from tf_als._src.scaling import tallies
from tf_als._src.training import state
from tf_als._src.failures import storm

NonFiniteGuard = storm.NonFiniteGuard  # Defined with the error it raises.

POINT_QUANTITIES = ("scale",) + state.RECORD_FIELDS
"""Per point and update: the per-layer scale, the cumulative scale, the
`tallies.GradientStatistics` of the incoming gradient, and the forward
headroom of the point's float16 output (`state.FORWARD_FIELDS`)."""

EPOCH_LOG_KEYS = ("loss_scale", "skipped_steps", "worst_subnormal_fraction")
"""What `ScaleHistory` adds to Keras's epoch logs."""

OVERVIEW_SCALARS = ("worst_subnormal_fraction", "worst_near_max_fraction")
"""Per update, over all points: the largest fraction of incoming gradient
elements still float16-subnormal after the point's scale
(`overview.subnormal_after_scale`: precision lost, the step before
underflow), and the largest `near_max_fraction` (overflow pressure)."""

OVERVIEW_IMAGE_TAG = "overview/log2_scale"
"""An image, rewritten at each update: the layers-by-updates heat map of
log2 per-layer scale (the last `OVERVIEW_UPDATES` updates), with the
layers' names and a numbered colour scale (`overview.overview_image`)."""

OVERVIEW_IMAGE_DESCRIPTION = (
    "log2 of each layer's scale (rows, in execution order) at each "
    "telemetry update (columns, oldest left). One colour per integer log2 "
    "scale present, numbered in the scale below the map; grey: no value. "
    "Tick 'Show actual image size' to see it pixel for pixel."
)

OVERVIEW_TEXT_TAG = "overview/worst_layers"
"""A text at each update naming the few worst layers by underflow and by
overflow pressure, with their values."""

OVERVIEW_UPDATES = 200
"""How many of the latest updates the heat map shows."""

RUN_NAME = "tf_als"
"""The subdirectory of `log_dir` the summaries go to (a TensorBoard run)."""

POINT_NAMES_TAG = "global/point_names"
"""A text summary, written once, listing the scaling points' names (one per
line, in execution order): tags cannot hold `/` in names, this can."""

PROMOTIONS_TAG = "global/promotions"
"""A text written at the step of each promotion to float32 (only when one
happens: see `promote_on_storm`)."""


def tag_group(point_name: str) -> str:
    """The TensorBoard tag group of a scaling point: its name with `/`
    replaced by `.` (TensorBoard folds tags by their first `/` component, so
    each layer gets its own fold)."""
    return point_name.replace("/", ".")


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

    Args:
        log_dir: str or None, where to write TensorBoard summaries.
        histograms: bool, default True. Also write the log2 histograms.

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

    def __init__(self, log_dir: Optional[str] = None, histograms: bool = True):
        super().__init__()
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
        self._writer = None
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
        if not isinstance(model, InstrumentedModel):
            raise TypeError(
                "ScaleHistory needs a model returned by tf_als.instrument(); "
                f"received {type(model).__name__} "
                f"{getattr(model, 'name', model)!r}."
            )
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

    def on_train_begin(self, logs=None):
        self._writer = None

    def on_train_batch_begin(self, batch, logs=None):
        self._iterations_before = _read_int(self._optimizer.iterations)
        self._batch_before = batch

    def on_train_batch_end(self, batch, logs=None):
        steps = 1
        if self._batch_before is not None:
            steps = batch - self._batch_before + 1
        self._observe(steps)

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        optimizer = self._optimizer
        logs["loss_scale"] = float(_read_float(optimizer.dynamic_scale))
        logs["skipped_steps"] = self.skipped_steps
        worst = overview.worst(self._subnormal_after_scale(), count=1)
        logs["worst_subnormal_fraction"] = worst[0][1] if worst else 0.0

    def _subnormal_after_scale(self) -> dict:
        """{point name: `overview.subnormal_after_scale`} at the last update."""
        return {
            name: overview.subnormal_after_scale(
                values["histogram"][-1], values["scale"][-1]
            )
            for name, values in self.history["points"].items()
            if values["histogram"]
        }

    def on_train_end(self, logs=None):
        self._note_promotions()
        if self._writer is not None:
            self._writer.flush()

    # -- custom loops ------------------------------------------------------

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
            if self.log_dir is not None:
                self._open_writer(promotion.step)
                with self._writer.as_default(step=promotion.step):
                    tf.summary.text(
                        PROMOTIONS_TAG,
                        f"layer {promotion.layer!r} promoted to float32 at "
                        f"step {promotion.step}: {promotion.reason}",
                    )

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
        if self.log_dir is not None:
            self._write(step, loss_scale, rows)

    def _write_overview(self):
        """The overview cards (inside the writer's default step)."""
        points = self.history["points"]
        underflow = self._subnormal_after_scale()
        overflow = {n: v["near_max_fraction"][-1] for n, v in points.items()}
        for quantity, values in zip(OVERVIEW_SCALARS, (underflow, overflow)):
            tf.summary.scalar(f"overview/{quantity}", max(values.values(), default=0.0))
        tf.summary.text(
            OVERVIEW_TEXT_TAG,
            _overview_text(overview.worst(underflow), overview.worst(overflow)),
        )
        scales = np.array([v["scale"][-OVERVIEW_UPDATES:] for v in points.values()])
        image = overview.overview_image(
            list(points), self.history["step"][-OVERVIEW_UPDATES:], np.log2(scales)
        )
        tf.summary.image(
            OVERVIEW_IMAGE_TAG, image[np.newaxis], max_outputs=1,
            description=OVERVIEW_IMAGE_DESCRIPTION,
        )

    def _open_writer(self, step):
        """Opens the writer at the first write, and lists the points."""
        if self._writer is not None:
            return
        self._writer = tf.summary.create_file_writer(
            os.path.join(self.log_dir, RUN_NAME)
        )
        with self._writer.as_default(step=step):
            tf.summary.text(
                POINT_NAMES_TAG,
                "\n".join(p.point_name for p in self.model.scaling_points),
            )

    def _write(self, step, loss_scale, rows):
        self._open_writer(step)
        with self._writer.as_default(step=step):
            tf.summary.scalar("global/loss_scale", loss_scale)
            tf.summary.scalar("global/skipped_steps", self.skipped_steps)
            self._write_overview()
            for name, values, histogram in rows:
                group = tag_group(name)
                for quantity in POINT_QUANTITIES:
                    tf.summary.scalar(f"{group}/{quantity}", values[quantity])
                if self.histograms:
                    _write_histogram(f"{group}/log2_magnitude", histogram, step)


def _overview_text(underflow, overflow):
    """Markdown naming the worst layers by underflow and by overflow."""

    def listing(pairs):
        return ", ".join(f"`{name}` {value:.2%}" for name, value in pairs) or "none"

    return (
        f"**underflow** (subnormal after scale): {listing(underflow)}  \n"
        f"**overflow pressure** (near float16 max): {listing(overflow)}"
    )


def _write_histogram(tag, fractions, step):
    """A TensorBoard histogram from precomputed buckets [e, e+1) per float16
    exponent e (the histogram plugin's [left, right, count] tensor)."""
    from tensorboard.plugins.histogram import metadata

    exponents = np.asarray(tallies.HISTOGRAM_EXPONENTS, np.float64)
    buckets = np.stack(
        [exponents, exponents + 1.0, np.asarray(fractions, np.float64)], axis=1
    )
    tf.summary.write(
        tag,
        tensor=tf.constant(buckets, tf.float64),
        step=step,
        metadata=metadata.create_summary_metadata(
            display_name=tag,
            description="fraction of gradient elements per log2 magnitude",
        ),
    )


def _read_int(variable):
    """A scalar variable (or tensor) as int. Its own `numpy()` takes half
    the time of `keras.ops.convert_to_numpy` (about 70 against 130
    microseconds on this project's CPU), and this runs after every batch;
    `int(variable)` would be faster still but fails on a variable a
    distribution strategy syncs on read."""
    return int(variable.numpy())


def _read_float(variable):
    return float(variable.numpy())
