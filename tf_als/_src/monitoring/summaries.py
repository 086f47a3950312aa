"""The TensorBoard side of `callbacks.ScaleHistory`: one run,
`<log_dir>/tf_als`, opened at the first write, with the overview cards,
per-point scalars and histograms of every telemetry update, and a text per
promotion. Only writes what `ScaleHistory` recorded."""

import os

import numpy as np
import tensorflow as tf

from tf_als._src.monitoring import overview
from tf_als._src.scaling import tallies
from tf_als._src.training import state

POINT_QUANTITIES = ("scale",) + state.RECORD_FIELDS

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


class Summaries:
    """Writes one model's records to TensorBoard under `log_dir` (see the
    module docstring); `histograms`: also the log2 histograms."""

    def __init__(self, log_dir: str, histograms: bool):
        self.log_dir = log_dir
        self.histograms = histograms
        self._writer = None

    def reset(self) -> None:
        """Opens a new writer at the next write (a new `fit`)."""
        self._writer = None

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def promotion(self, promotion, point_names) -> None:
        """A text at the step of `promotion` (a `promote.Promotion`)."""
        self._open(promotion.step, point_names)
        with self._writer.as_default(step=promotion.step):
            tf.summary.text(
                PROMOTIONS_TAG,
                f"layer {promotion.layer!r} promoted to float32 at "
                f"step {promotion.step}: {promotion.reason}",
            )

    def update(self, step, history, rows, underflow) -> None:
        """The update at `step`: the global scalars (the last of
        `history`'s), the overview (`underflow`: {point: subnormal share
        after its scale}) and each of `rows` ((point, values, histogram))."""
        self._open(step, list(history["points"]))
        with self._writer.as_default(step=step):
            tf.summary.scalar("global/loss_scale", history["loss_scale"][-1])
            tf.summary.scalar("global/skipped_steps", history["skipped_steps"][-1])
            _write_overview(history, underflow)
            for name, values, histogram in rows:
                group = tag_group(name)
                for quantity in POINT_QUANTITIES:
                    tf.summary.scalar(f"{group}/{quantity}", values[quantity])
                if self.histograms:
                    _write_histogram(f"{group}/log2_magnitude", histogram, step)

    def _open(self, step, point_names):
        """Opens the writer at the first write, and lists the points."""
        if self._writer is not None:
            return
        self._writer = tf.summary.create_file_writer(
            os.path.join(self.log_dir, RUN_NAME)
        )
        with self._writer.as_default(step=step):
            tf.summary.text(POINT_NAMES_TAG, "\n".join(point_names))


def _write_overview(history, underflow):
    """The overview cards (inside the writer's default step)."""
    points = history["points"]
    overflow = {n: v["near_max_fraction"][-1] for n, v in points.items()}
    for quantity, values in zip(OVERVIEW_SCALARS, (underflow, overflow)):
        tf.summary.scalar(f"overview/{quantity}", max(values.values(), default=0.0))
    tf.summary.text(
        OVERVIEW_TEXT_TAG,
        _overview_text(overview.worst(underflow), overview.worst(overflow)),
    )
    scales = np.array([v["scale"][-OVERVIEW_UPDATES:] for v in points.values()])
    image = overview.overview_image(
        list(points), history["step"][-OVERVIEW_UPDATES:], np.log2(scales)
    )
    tf.summary.image(
        OVERVIEW_IMAGE_TAG, image[np.newaxis], max_outputs=1,
        description=OVERVIEW_IMAGE_DESCRIPTION,
    )


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
