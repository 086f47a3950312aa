"""The state of one scaling point: its scale and what it last measured.

A `ScalingPoint` holds variables only; it is never called in the model's
graph. The backward pass writes it at scale updates, callbacks and
`tf_als.scales()` read it, checkpoints and `model.save` store it.
"""

import keras
import tensorflow as tf

from tf_als import policy

# Each field: (variable name, dtype, initial value).
_FIELDS = (
    ("scale", "float32", 1.0),
    ("cumulative_scale", "float32", 1.0),
    ("percentile", "float32", 0.0),
    ("amax", "float32", 0.0),
    ("zero_fraction", "float32", 0.0),
    ("subnormal_fraction", "float32", 0.0),
    ("near_max_fraction", "float32", 0.0),
    ("last_update", "int64", -1),
    ("updates", "int64", 0),
)
FIELD_NAMES = tuple(name for name, _, _ in _FIELDS)


@keras.saving.register_keras_serializable(package="tf_als")
class ScalingPoint(keras.layers.Layer):
    """Variables of one scaling point (one call of a layer with weights).

    Variables (all non-trainable scalars):

    - `scale`: s_n, the per-layer scale, a power of two >= 1.
    - `cumulative_scale`: T_in(n) = s_n * T_out(n) at the last update: the
      scale, relative to the global loss scale, that this layer's input and
      weight gradients carry.
    - `percentile`, `amax`, `zero_fraction`, `subnormal_fraction`,
      `near_max_fraction`: `tf_als.policy.GradientStatistics` of the
      incoming gradient at the last update (aggregated over replicas).
    - `last_update`: the optimizer step of the last update (-1: never).
    - `updates`: how many updates have happened.

    Under `tf.distribute` every replica writes the same (aggregated) values,
    so the variables are synchronised on read from the first replica.

    Args:
        point_name: str, the scaling point's name as `tf_als.scales()`
            reports it (layer path and call).
        **kwargs: passed to `keras.layers.Layer` (`name`, ...).
    """

    def __init__(self, point_name, **kwargs):
        kwargs.setdefault("dtype", "float32")
        super().__init__(trainable=False, **kwargs)
        self.point_name = point_name
        for field, dtype, initial in _FIELDS:
            variable = keras.Variable(
                initializer=keras.initializers.Constant(initial),
                shape=(),
                dtype=dtype,
                trainable=False,
                name=field,
                aggregation="only_first_replica",
                synchronization="on_read",
            )
            setattr(self, field, variable)
        self.built = True

    def record(self, scale, cumulative_scale, statistics, step):
        """Stores one update. All arguments are tensors (graph-safe)."""
        assigns = [
            self.scale.assign(scale),
            self.cumulative_scale.assign(cumulative_scale),
            self.percentile.assign(statistics.percentile),
            self.amax.assign(statistics.amax),
            self.zero_fraction.assign(statistics.zero_fraction),
            self.subnormal_fraction.assign(statistics.subnormal_fraction),
            self.near_max_fraction.assign(statistics.near_max_fraction),
            self.last_update.assign(tf.cast(step, tf.int64)),
            self.updates.assign_add(tf.constant(1, tf.int64)),
        ]
        return assigns

    def statistics(self):
        """The last recorded `GradientStatistics` (as tensors)."""
        return policy.GradientStatistics(
            percentile=tf.convert_to_tensor(self.percentile),
            amax=tf.convert_to_tensor(self.amax),
            zero_fraction=tf.convert_to_tensor(self.zero_fraction),
            subnormal_fraction=tf.convert_to_tensor(self.subnormal_fraction),
            near_max_fraction=tf.convert_to_tensor(self.near_max_fraction),
        )

    def call(self, inputs):
        raise TypeError(
            f"ScalingPoint {self.point_name!r} holds state only and is not "
            "called; tf_als applies it inside the instrumented model."
        )

    def get_config(self):
        config = super().get_config()
        config.pop("trainable", None)
        config["point_name"] = self.point_name
        return config
