"""Pictures of a scale history: a layers-by-updates heat map of log2 scale
and each layer's zero fraction over time, as a PNG. Needs matplotlib
(`pip install tf_als[plot]`)."""

import dataclasses
import os

import numpy as np

from tf_als._src.monitoring import callbacks


@dataclasses.dataclass(frozen=True)
class ScalePlot:
    """What `plot_history` drew.

    Attributes:
        path: the PNG written.
        points: row labels of the heat map, one per scaling point.
        steps: the optimizer step of each column (each telemetry record).
        log2_scales: array [points, steps], log2 of each per-layer scale.
        zero_fractions: array [points, steps], each point's fraction of
            exactly-zero elements in its incoming gradient.
        width, height: the image size in pixels.
    """

    path: str
    points: tuple
    steps: tuple
    log2_scales: np.ndarray
    zero_fractions: np.ndarray
    width: int
    height: int


def plot_history(source, path, *, width=1000, height=700, dpi=100) -> ScalePlot:
    """Draws a scale history to a PNG file.

    Args:
        source: a `tf_als.callbacks.ScaleHistory`, its `history` dict, or a
            TensorBoard log directory a `ScaleHistory(log_dir=...)` wrote
            (the directory given to the callback, or its `tf_als` run).
        path: str, the PNG file to write (its directory must exist).
        width, height: int, image size in pixels.
        dpi: int, resolution (sizes of text and lines).

    Returns:
        A `ScalePlot` with the data behind the picture.

    Example:

    ```python
    history = tf_als.callbacks.ScaleHistory()
    model.fit(x, y, callbacks=[history])
    tf_als.plots.plot_history(history, "scales.png")
    ```
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - depends on the install
        raise ImportError(
            "tf_als.plots needs matplotlib: pip install 'tf_als[plot]'"
        ) from error
    points, steps, log2_scales, zero_fractions = _series(source)
    if not steps:
        raise ValueError(
            "The scale history is empty: no telemetry step has been recorded "
            "yet (train at least one step with the callback attached)."
        )
    for name, value in (("width", width), ("height", height), ("dpi", dpi)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"`{name}` must be a positive int; received {value!r}.")

    # Matplotlib's object API, not pyplot: the user's backend and figures
    # are left alone.
    figure = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, gridspec_kw={"height_ratios": [3, 2]})
    _draw_scales(figure, top, points, steps, log2_scales)
    _draw_zero_fractions(bottom, points, steps, zero_fractions)
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    return ScalePlot(
        path=os.fspath(path),
        points=tuple(points),
        steps=tuple(steps),
        log2_scales=log2_scales,
        zero_fractions=zero_fractions,
        width=width,
        height=height,
    )


def _draw_scales(figure, axes, points, steps, log2_scales):
    """The layers-by-updates heat map of log2 scale."""
    from matplotlib import ticker

    image = axes.imshow(
        log2_scales, aspect="auto", interpolation="nearest", cmap="viridis"
    )
    axes.set_title("log2 per-layer scale at each update")
    axes.set_yticks(range(len(points)))
    axes.set_yticklabels(points, fontsize=max(4, min(8, 400 // max(len(points), 1))))
    ticks = np.linspace(0, len(steps) - 1, min(len(steps), 10)).astype(int)
    axes.set_xticks(ticks)
    axes.set_xticklabels([str(steps[i]) for i in ticks])
    axes.set_xlabel("optimizer step")
    colour_bar = figure.colorbar(image, ax=axes, label="log2 scale")
    colour_bar.locator = ticker.MaxNLocator(integer=True)  # scales are 2**k
    colour_bar.update_ticks()


MARKED_UPDATES = 30
"""Up to this many updates, each value of the zero-fraction panel is also
drawn as a dot: a line through one update has no length."""


def _draw_zero_fractions(axes, points, steps, zero_fractions):
    """Each layer's zero fraction over the updates (a legend up to 12)."""
    from matplotlib import ticker

    marker = "o" if len(steps) <= MARKED_UPDATES else None
    for row, name in zip(zero_fractions, points):
        axes.plot(steps, row, label=name, linewidth=1, marker=marker, markersize=3)
    axes.set_title("fraction of exact zeros in each layer's incoming gradient")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("zero fraction")
    if len(steps) == 1:
        axes.set_xticks(steps)
    else:
        axes.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    if len(points) <= 12:
        axes.legend(fontsize=6, ncol=2)


def _series(source):
    """(point labels, steps, log2 scales [p, s], zero fractions [p, s])."""
    if isinstance(source, callbacks.ScaleHistory):
        source = source.history
    if isinstance(source, dict):
        points = list(source["points"])
        steps = list(source["step"])
        scales = np.array(
            [source["points"][p]["scale"] for p in points], np.float64
        ).reshape(len(points), len(steps))
        zeros = np.array(
            [source["points"][p]["zero_fraction"] for p in points], np.float64
        ).reshape(len(points), len(steps))
        return points, steps, np.log2(scales), zeros
    if isinstance(source, (str, os.PathLike)):
        return _series_from_log_dir(os.fspath(source))
    raise TypeError(
        "`source` must be a ScaleHistory, its `history` dict or a log "
        f"directory; received {type(source).__name__}."
    )


def _series_from_log_dir(log_dir):
    from tensorboard.backend.event_processing import event_accumulator

    run = log_dir
    if os.path.isdir(os.path.join(log_dir, callbacks.RUN_NAME)):
        run = os.path.join(log_dir, callbacks.RUN_NAME)
    if not os.path.isdir(run):
        raise FileNotFoundError(f"No log directory at {run!r}.")
    accumulator = event_accumulator.EventAccumulator(
        run, size_guidance={event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    tags = accumulator.Tags()[event_accumulator.TENSORS]
    if callbacks.POINT_NAMES_TAG not in tags:
        raise ValueError(f"{run!r} holds no tf_als scale summaries.")
    text = accumulator.Tensors(callbacks.POINT_NAMES_TAG)[0].tensor_proto
    names = _to_array(text).item().decode("utf-8").split("\n")
    groups = [callbacks.tag_group(name) for name in names]

    def series(tag):
        events = accumulator.Tensors(tag)
        return {
            e.step: float(np.asarray(_to_array(e.tensor_proto)))
            for e in events
        }

    scale_series = [series(f"{g}/scale") for g in groups]
    zero_series = [series(f"{g}/zero_fraction") for g in groups]
    steps = sorted(set().union(*[s.keys() for s in scale_series]))
    scales = np.array([[s.get(t, np.nan) for t in steps] for s in scale_series])
    zeros = np.array([[s.get(t, np.nan) for t in steps] for s in zero_series])
    return names, steps, np.log2(scales), zeros


def _to_array(tensor_proto):
    import tensorflow as tf

    return tf.make_ndarray(tensor_proto)
