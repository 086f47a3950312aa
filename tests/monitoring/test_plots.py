"""`tf_als.plots.plot_history`: a valid PNG of the requested size whose heat
map has one row per scaling point, from a callback or from a log dir."""

import struct

import numpy as np
import pytest

from tf_als._src.monitoring import callbacks
from tf_als._src.monitoring import plots
from tests.monitoring import test_callbacks


def _png_size(path):
    with open(path, "rb") as handle:
        head = handle.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


@pytest.fixture
def trained(mixed, tmp_path):
    model = test_callbacks._model(interval=2)
    log_dir = str(tmp_path / "logs")
    history = callbacks.ScaleHistory(log_dir=log_dir)
    x, y, batch = test_callbacks._data(5)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[history])
    return model, history, log_dir


def test_plot_from_history(trained, tmp_path):
    model, history, _ = trained
    path = str(tmp_path / "scales.png")
    plot = plots.plot_history(history, path, width=800, height=600)
    assert _png_size(path) == (800, 600)
    names = [p.point_name for p in model.scaling_points]
    assert plot.points == tuple(names)
    assert plot.steps == (0, 2, 4)
    assert plot.log2_scales.shape == (len(names), 3)
    expected = np.log2([history.history["points"][n]["scale"] for n in names])
    np.testing.assert_array_equal(plot.log2_scales, expected)
    zeros = [history.history["points"][n]["zero_fraction"] for n in names]
    np.testing.assert_array_equal(plot.zero_fractions, zeros)


def test_plot_from_log_dir_matches_the_history(trained, tmp_path):
    _, history, log_dir = trained
    from_history = plots.plot_history(history, str(tmp_path / "a.png"))
    from_logs = plots.plot_history(log_dir, str(tmp_path / "b.png"))
    assert from_logs.points == from_history.points
    assert from_logs.steps == from_history.steps
    np.testing.assert_allclose(from_logs.log2_scales, from_history.log2_scales)
    np.testing.assert_allclose(
        from_logs.zero_fractions, from_history.zero_fractions, rtol=1e-7
    )
    assert _png_size(str(tmp_path / "b.png")) == (1000, 700)


def test_plot_errors(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        plots.plot_history(
            {"step": [], "points": {}}, str(tmp_path / "x.png")
        )
    with pytest.raises(TypeError, match="ScaleHistory"):
        plots.plot_history(3, str(tmp_path / "x.png"))
    with pytest.raises(FileNotFoundError):
        plots.plot_history(str(tmp_path / "missing"), str(tmp_path / "x.png"))


def _coloured_pixels(path, rows):
    """How many pixels in the fraction `rows` (a slice of 0..1) of the
    image's height are clearly coloured (not white, grey or black)."""
    import matplotlib.image

    pixels = (matplotlib.image.imread(path)[..., :3] * 255).astype(int)
    height = pixels.shape[0]
    band = pixels[int(rows.start * height) : int(rows.stop * height)]
    return int(np.sum(band.max(axis=-1) - band.min(axis=-1) > 80))


def _one_update(points):
    return {
        "step": [0],
        "points": {
            f"layer_{i}": {"scale": [2.0**i], "zero_fraction": [i / points]}
            for i in range(points)
        },
    }


@pytest.mark.parametrize("points", [1, 13])  # with a legend, and without
def test_one_update_draws_the_zero_fractions(tmp_path, points):
    """A line through one update has no length: each value is a dot.
    The zero-fraction panel is the lower 2/5 of the figure (below the heat
    map's axis label); with 13 points it has no legend, so every coloured
    pixel there is data."""
    path = str(tmp_path / "one.png")
    plot = plots.plot_history(_one_update(points), path, width=600, height=500)
    assert plot.steps == (0,) and plot.zero_fractions.shape == (points, 1)
    dots = _coloured_pixels(path, slice(0.65, 1.0))
    # A 3-point dot at 100 dpi covers about 12 pixels; one per point.
    assert dots >= 8 * points, dots


def test_the_users_backend_is_left_alone(tmp_path):
    import matplotlib

    before = matplotlib.get_backend()
    matplotlib.use("pdf")  # not Agg, so that switching to Agg would show
    try:
        plots.plot_history(_one_update(2), str(tmp_path / "b.png"))
        assert matplotlib.get_backend() == "pdf"
    finally:
        matplotlib.use(before)
