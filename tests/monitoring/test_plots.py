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
