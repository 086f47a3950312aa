"""`plot_history(source, path)`: a PNG of a scale history (log2 scale and
zero fraction per layer over time). Part of the public surface
(`tf_als.plots`); defined in `tf_als._src`. Needs matplotlib
(`pip install tf_als[plot]`)."""

from tf_als._src.monitoring.plots import ScalePlot
from tf_als._src.monitoring.plots import plot_history

__all__ = ["ScalePlot", "plot_history"]
