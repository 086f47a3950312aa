"""Keras callbacks: `ScaleHistory` records what the scaler did per scaling
point (TensorBoard, `history.history`); `NonFiniteGuard` stops a run whose
steps are all being skipped. Part of the public surface (`tf_als.callbacks`);
they are defined in `tf_als._src`."""

from tf_als._src.failures.storm import NonFiniteGuard
from tf_als._src.monitoring.callbacks import ScaleHistory

__all__ = ["NonFiniteGuard", "ScaleHistory"]
