"""The state of one scaling point: its scale and what it last measured.

A `ScalingPoint` holds variables only; it is never called in the model's
graph. The backward pass writes it, callbacks and `tf_als.scales()` read it,
checkpoints and `model.save` store it.
"""

import keras
import numpy as np
import tensorflow as tf

from tf_als import rule

# Layout of the `record` vector: the cumulative scale, then the fields of
# `rule.GradientStatistics` in order.
RECORD_FIELDS = ("cumulative_scale",) + rule.GradientStatistics._fields


@keras.saving.register_keras_serializable(package="tf_als")
class ScalingPoint(keras.layers.Layer):
    """Variables of one scaling point (one call of a layer with weights).

    Variables (non-trainable):

    - `scale`: float32 scalar, s_n, the per-layer scale, a power of two
      >= 1 / T_out(n) (below 1 it gives back lift inherited from downstream).
    - `record`: float32 vector, what the last update measured and decided,
      fields in `RECORD_FIELDS` order:
      `cumulative_scale` T_in(n) = s_n * T_out(n), the scale (relative to
      the global loss scale S) that the layer's input and weight gradients
      carry; then the incoming gradient's `percentile`, `amax`,
      `zero_fraction`, `subnormal_fraction` and `near_max_fraction`
      (see `tf_als.rule.GradientStatistics`), aggregated over replicas.
    - `histogram`: float32 vector, `tf_als.rule.log2_histogram` of the
      incoming gradient at the last update (one bin per exponent in
      `tf_als.rule.HISTOGRAM_EXPONENTS`).
    - `last_update`: int64 scalar, the optimizer step of the last update
      (-1 before the first).
    - `measured`: float32 vector, what the backward pass of the last
      update step measured of the incoming gradient, before any exchange
      between replicas: the scale T_out it carried, then its
      `tf_als.rule.tally` (amax and a count per binary exponent).
    - `measured_step`: int64 scalar, the step of that measurement (-1
      before the first).

    On update steps the backward pass writes `measured` and
    `measured_step` (each replica its own), and the optimizer's `apply`
    then writes the others (see `tf_als.update`). Under `tf.distribute`
    every replica writes the same, aggregated values into the others, so
    all are synchronised on read from the first replica.

    Args:
        point_name: str, the scaling point's name as `tf_als.scales()`
            reports it (layer path and call).
        **kwargs: passed to `keras.layers.Layer` (`name`, ...).
    """

    def __init__(self, point_name, **kwargs):
        kwargs.setdefault("dtype", "float32")
        kwargs.pop("trainable", None)
        super().__init__(trainable=False, **kwargs)
        self.point_name = point_name
        initial_record = np.zeros([len(RECORD_FIELDS)], np.float32)
        initial_record[0] = 1.0
        self.scale = self._state("scale", (), "float32", 1.0)
        self.record = self._state(
            "record", (len(RECORD_FIELDS),), "float32", initial_record
        )
        self.histogram = self._state(
            "histogram",
            (len(rule.HISTOGRAM_EXPONENTS),),
            "float32",
            np.zeros([len(rule.HISTOGRAM_EXPONENTS)], np.float32),
        )
        self.last_update = self._state("last_update", (), "int64", -1)
        self.measured = self._state(
            "measured",
            (1 + rule.TALLY_SIZE,),
            "float32",
            np.zeros([1 + rule.TALLY_SIZE], np.float32),
        )
        self.measured_step = self._state("measured_step", (), "int64", -1)
        self.built = True

    def _state(self, name, shape, dtype, initial):
        return keras.Variable(
            initializer=keras.initializers.Constant(initial),
            shape=shape,
            dtype=dtype,
            trainable=False,
            name=name,
            aggregation="only_first_replica",
            synchronization="on_read",
        )

    def read(self):
        """The current state as plain Python values: `{"scale": float,
        "last_update": int, <RECORD_FIELDS>: float}` (the histogram is
        `read_histogram()`)."""
        values = {
            "scale": float(keras.ops.convert_to_numpy(self.scale)),
            "last_update": int(keras.ops.convert_to_numpy(self.last_update)),
        }
        record = keras.ops.convert_to_numpy(self.record)
        values.update(
            {field: float(v) for field, v in zip(RECORD_FIELDS, record)}
        )
        return values

    def read_histogram(self):
        """The last recorded log2 histogram, as a numpy array."""
        return keras.ops.convert_to_numpy(self.histogram)

    def call(self, inputs):
        raise TypeError(
            f"ScalingPoint {self.point_name!r} holds state only and is not "
            "called; tf_als applies it inside the instrumented model."
        )

    def get_config(self):
        config = super().get_config()
        config["point_name"] = self.point_name
        return config


def record_vector(cumulative_scale, statistics, axis=0):
    """Packs a cumulative scale and `GradientStatistics` into a record (or,
    with `axis=1`, [points] of each into [points, record] rows)."""
    return tf.stack(
        [tf.cast(cumulative_scale, tf.float32)]
        + [tf.cast(v, tf.float32) for v in statistics],
        axis=axis,
    )
