"""The state of the scaling points: their scales and what they measured.

An instrumented model holds one `ScalingState`: a few `[points, ...]`
variables, row i for point i. The backward pass reads the global scale's
back-off (and, under the paper's rule, the scales and whether an update is
due); the optimizer's `apply` writes what the pass chose and measured
(`update`); callbacks, `tf_als.scales()`, checkpoints and
`model.save` read or store it. A `ScalingPoint` is one point's view of
those rows.

Stacking matters for speed: every variable a compiled step touches costs
time on every step (XLA passes each one in and out of the computation) and
compile time once, so `[points]` variables cost what a few per-point ones
did.
"""

import keras
import numpy as np
import tensorflow as tf


from tf_als._src.scaling import tallies

# The forward headroom of a point's float16 outputs
# (`rule.headroom_of_tallies`): their amax, and the share of elements within
# `rule.NEAR_MAX_FACTOR` of float16's maximum.
FORWARD_FIELDS = ("forward_amax", "forward_near_max_fraction")
# Layout of a `records` row: the cumulative scale, the fields of
# `tallies.GradientStatistics` in order, then `FORWARD_FIELDS` (new columns
# go last, so an older file's rows load as a prefix).
RECORD_FIELDS = ("cumulative_scale",) + tallies.GradientStatistics._fields + FORWARD_FIELDS
# The variables, in the order they are created (and saved).
VARIABLES = (
    "scales", "records", "histograms", "last_updates", "due", "backoff",
    "zero_gradient_steps", "telemetry_next", "gains",
)
# Older `.keras` layouts: each variable's name by position (None: since
# removed). 0.5 saved eight variables (no `gains`); 0.4 seven (no `telemetry_next`); 0.3 six (no
# `zero_gradient_steps`); 0.2 six too, its last two the per-point
# measurement rows and their step counts (no `due`, no `backoff`); and
# main between 0.2 and 0.3 seven, the measurement rows, a pending flag per
# point and `due`. 0.2 and 0.3 saved records of `_OLD_RECORD_FIELDS`
# columns (no forward headroom).
_LAYOUT_0_5 = VARIABLES[:8]
_LAYOUT_0_4 = VARIABLES[:7]
_LAYOUT_0_3 = VARIABLES[:6]
_LAYOUT_0_2 = ("scales", "records", "histograms", "last_updates", None, None)
_LAYOUT_AFTER_0_2 = _LAYOUT_0_2 + ("due",)
_OLD_RECORD_FIELDS = len(RECORD_FIELDS) - len(FORWARD_FIELDS)


@keras.saving.register_keras_serializable(package="tf_als")
class ScalingState(keras.layers.Layer):
    """Variables of every scaling point of an instrumented model, stacked.

    Row i of each variable belongs to the point `point_names[i]`. All are
    non-trainable:

    - `scales`: float32 `[points]`, each s_n, the per-layer scale, a power
      of two >= 1 / T_out(n) (below 1 it gives back lift inherited from
      downstream).
    - `records`: float32 `[points, len(RECORD_FIELDS)]`, what the last
      telemetry step measured and chose: `cumulative_scale` T_in(n) = s_n *
      T_out(n), the scale (relative to the global loss scale S) that the
      layer's input and weight gradients carry; then the incoming
      gradient's `percentile`, `amax`, `zero_fraction`,
      `subnormal_fraction` and `near_max_fraction` (see
      `tallies.GradientStatistics`; amax is exact, the rest are
      estimated from a sample of the gradient, `tallies.sample`); then
      the point's float16 forward outputs' `forward_amax` and
      `forward_near_max_fraction`, the share of their elements with
      magnitude >= 65504 / `rule.NEAR_MAX_FACTOR` (both exact; 0
      for a point without float16 outputs, such as a layer in float32).
    - `histograms`: float32 `[points, len(tallies.HISTOGRAM_EXPONENTS)]`, the
      log2 histogram (`tallies.statistics_of_tallies`) of each incoming gradient's sample at
      the last telemetry step.
    - `last_updates`: int64 `[points]`, the optimizer step of each point's
      last telemetry record (-1 before the first).
    - `due`: int64 scalar, 1 when the next backward pass updates the
      scales under the paper's rule (`rule="paper"`; the default rule
      chooses on every step). An `AdaptiveLossScaleOptimizer` that applies
      the model's gradients sets it after each step, from its own step
      counter (see `schedule`); it starts at 1.
    - `backoff`: float32 scalar >= 1, how far the global loss scale of the
      optimizer that applies the model's gradients has backed off below
      its initial value (`rule.choose_scale`'s `backoff`), written
      by that optimizer after each step; 1 until then.
    - `zero_gradient_steps`: int32 scalar, how many applied steps in a row
      every point the backward pass reached received an incoming gradient
      that was exactly zero everywhere (0 after any other step): a loss
      stuck at a constant, such as a float16 sum that overflowed
      (`silent` warns).
    - `telemetry_next`: int64 scalar, 1 when the coming step is a telemetry
      step (the optimizer writes it after each step, as `due`): the forward
      pass measures its outputs' headroom then.
    - `gains`: float32 `[points]`, how much larger each point's weight
      gradients came out than the gradient it received, in true units
      (their amax over the received amax), on its last step; inf when a
      weight gradient was not finite while the received one was, 0 until
      measured. The point's next scale keeps its weight gradients within
      float16 (`rule.produced_headroom`); the optimizer writes it after each
      step (`update.write_gains`), the first-batch check before the first.

    The scales are chosen inside the backward pass, each from the
    gradient it is applied to; the `apply` of an optimizer applying the
    model's gradients writes them, and every `telemetry_interval` steps
    the records and histograms (see `update`). Under
    `tf.distribute` every replica chooses and records its own (each
    replica's weight gradients are unscaled before they are summed); a
    read gives the first replica's.

    Args:
        point_names: the scaling points' names, as `tf_als.scales()`
            reports them, in row order.
        **kwargs: passed to `keras.layers.Layer` (`name`, ...).

    Example:

    >>> state = ScalingState(["dense", "head"])
    >>> _ = state.point(1).scale.assign(4.0)
    >>> keras.ops.convert_to_numpy(state.scales).tolist()
    [1.0, 4.0]
    >>> state.point(1).read()["last_update"]
    -1
    """

    def __init__(self, point_names, **kwargs):
        kwargs.setdefault("dtype", "float32")
        kwargs.pop("trainable", None)
        super().__init__(trainable=False, **kwargs)
        self.point_names = tuple(point_names)
        if not all(isinstance(n, str) for n in self.point_names):
            raise TypeError(
                "`point_names` must be strings; received "
                f"{list(point_names)!r}."
            )
        points = len(self.point_names)
        records = np.zeros([points, len(RECORD_FIELDS)], np.float32)
        records[:, 0] = 1.0
        self.scales = self._state("scales", np.ones([points], np.float32))
        self.records = self._state("records", records)
        self.histograms = self._state(
            "histograms",
            np.zeros([points, len(tallies.HISTOGRAM_EXPONENTS)], np.float32),
        )
        self.last_updates = self._state("last_updates", np.full([points], -1, np.int64))
        self.due = self._state("due", np.ones([], np.int64))
        self.backoff = self._state("backoff", np.ones([], np.float32))
        self.zero_gradient_steps = self._state(
            "zero_gradient_steps", np.zeros([], np.int32)
        )
        self.telemetry_next = self._state("telemetry_next", np.ones([], np.int64))
        self.gains = self._state("gains", np.zeros([points], np.float32))
        self.built = True

    def _state(self, name, initial):
        return keras.Variable(
            initializer=keras.initializers.Constant(initial),
            shape=initial.shape,
            dtype=str(initial.dtype),
            trainable=False,
            name=name,
            aggregation="only_first_replica",
            synchronization="on_read",
        )

    def read(self) -> list:
        """Every row as plain Python values, one read per variable:
        `(values, histogram)` per point, `values` as
        `ScalingPoint.read()` gives them."""
        scales, records, histograms, last_updates = (
            keras.ops.convert_to_numpy(v)
            for v in (self.scales, self.records, self.histograms, self.last_updates)
        )
        rows = []
        for i in range(len(self.point_names)):
            values = {"scale": float(scales[i]), "last_update": int(last_updates[i])}
            values.update({f: float(v) for f, v in zip(RECORD_FIELDS, records[i])})
            rows.append((values, histograms[i]))
        return rows

    def point(self, index: int) -> "ScalingPoint":
        """Point `index`'s view of the rows."""
        return ScalingPoint(self, index)

    def load_own_variables(self, store):
        """Loads the variables a `.keras` file saved. Files of 0.2-0.5 load
        too: what they lack keeps its initial value (back-off 1, forward
        columns 0, no zero-gradient steps, telemetry due, gains not
        measured)."""
        layout = _old_layout(store)
        if layout is None:
            super().load_own_variables(store)
            return
        records = store[str(layout.index("records"))]
        if np.shape(records)[-1] != len(RECORD_FIELDS):
            records = self._with_old_records(records)
        for key, name in enumerate(layout):
            if name is not None:
                getattr(self, name).assign(records if name == "records" else store[str(key)])

    def _with_old_records(self, old):
        """The records with record rows of `_OLD_RECORD_FIELDS` columns
        (checked before anything is assigned) as their first columns (the
        forward columns stay 0)."""
        old = np.asarray(old, np.float32)
        if old.shape != (len(self.point_names), _OLD_RECORD_FIELDS):
            raise ValueError(
                f"ScalingState {self.name!r} cannot load saved records of "
                f"shape {old.shape}: this model has {len(self.point_names)} "
                f"scaling points and a file of tf_als 0.2 or 0.3 holds "
                f"{_OLD_RECORD_FIELDS} columns per point. Load it into the "
                "model it was saved from."
            )
        records = keras.ops.convert_to_numpy(self.records).copy()
        records[:, :_OLD_RECORD_FIELDS] = old
        return records

    def call(self, inputs):
        raise TypeError(
            f"ScalingState {self.name!r} holds state only and is not "
            "called; tf_als applies it inside the instrumented model."
        )

    def get_config(self):
        config = super().get_config()
        config["point_names"] = list(self.point_names)
        return config


class ScalingPoint:
    """One scaling point's view of its `ScalingState` rows.

    `scale`, `record`, `histogram` and `last_update` are `Row`s: read them
    with `numpy()` (or `np.asarray`, `float`, `tf.convert_to_tensor`),
    write them with `assign`.

    Args:
        state: the `ScalingState`.
        index: the point's row.
    """

    def __init__(self, state: ScalingState, index: int):
        self.state = state
        self.index = int(index)
        self.point_name = state.point_names[self.index]

    @property
    def scale(self) -> "Row":
        """s_n (float32)."""
        return Row(self.state.scales, self.index)

    @property
    def record(self) -> "Row":
        """The last update's record (float32, `RECORD_FIELDS` order)."""
        return Row(self.state.records, self.index)

    @property
    def histogram(self) -> "Row":
        """The last update's log2 histogram (float32)."""
        return Row(self.state.histograms, self.index)

    @property
    def last_update(self) -> "Row":
        """The step of the last update (int64; -1 before the first)."""
        return Row(self.state.last_updates, self.index)

    def read(self) -> dict:
        """The current state as plain Python values: `{"scale": float,
        "last_update": int, <RECORD_FIELDS>: float}` (the histogram is
        `read_histogram()`)."""
        return self.state.read()[self.index][0]

    def read_histogram(self) -> np.ndarray:
        """The last recorded log2 histogram."""
        return self.histogram.numpy()

    def __repr__(self):
        return f"<ScalingPoint {self.index} {self.point_name!r}>"


class Row:
    """Row `index` of a stacked state variable, read and written like a
    variable of its own.

    Args:
        variable: a `ScalingState` variable.
        index: the row.
    """

    def __init__(self, variable, index: int):
        self.variable = variable
        self.index = index

    def numpy(self) -> np.ndarray:
        """The row's value (as the first replica holds it)."""
        return np.asarray(keras.ops.convert_to_numpy(self.variable)[self.index])

    def replica_values(self) -> list:
        """The row as each replica holds it (one entry without a
        strategy)."""
        value = self.variable.value
        components = getattr(value, "values", None) or (value,)
        return [np.asarray(np.asarray(v)[self.index]) for v in components]

    def assign(self, value):
        """Writes the row (in eager code, a `tf.function` or a replica)."""
        return _assign_row(self.variable, self.index, value)

    def __array__(self, dtype=None, copy=None):
        value = self.numpy()
        return value if dtype is None else value.astype(dtype)

    def __tf_tensor__(self, dtype=None, name=None):
        """The row as a tensor, for `tf.convert_to_tensor(row)` and any op
        given a row (TensorFlow's `TensorProtocol`: no conversion function
        is registered globally)."""
        value = tf.gather(tf.convert_to_tensor(self.variable), self.index)
        return value if dtype is None else tf.cast(value, dtype, name=name)

    def __float__(self):
        return float(self.numpy())

    def __int__(self):
        return int(self.numpy())

    def __repr__(self):
        return f"<Row {self.index} of {self.variable.name}: {self.numpy()!r}>"


def _assign_row(variable, index, value):
    current = tf.convert_to_tensor(variable)
    value = tf.cast(value, current.dtype)
    return variable.assign(
        tf.tensor_scatter_nd_update(current, [[index]], value[tf.newaxis])
    )


def record_vector(cumulative_scale, statistics, forward=None, axis=0):
    """Packs a cumulative scale, `GradientStatistics` and the forward
    headroom (`(forward_amax, forward_near_max_fraction)`, zeros if None)
    into a record in `RECORD_FIELDS` order (or, with `axis=1`, [points] of
    each into [points, record] rows).

    >>> statistics, _ = tallies.statistics_of_tallies(
    ...     tallies.tallies([tf.constant([0.0, 2.0])]), 0.01)
    >>> stats = [field[0] for field in statistics]
    >>> record_vector(4.0, stats, (100.0, 0.0)).numpy().tolist()
    [4.0, 2.0, 2.0, 0.5, 0.0, 0.0, 100.0, 0.0]
    """
    cumulative_scale = tf.cast(cumulative_scale, tf.float32)
    if forward is None:
        forward = (tf.zeros_like(cumulative_scale),) * len(FORWARD_FIELDS)
    return tf.stack(
        [cumulative_scale] + [tf.cast(v, tf.float32) for v in (*statistics, *forward)],
        axis=axis,
    )


def _old_layout(store):
    """The layout (`_LAYOUT_0_2`...) of a `ScalingState` saved by tf_als
    0.2-0.5 in `store`; None for today's (nine variables)."""
    count = len(store.keys())
    if count == 8:
        return _LAYOUT_0_5
    # 0.2's fifth variable holds rows, 0.3's and 0.4's (`due`) is a scalar.
    before_0_3 = count in (6, 7) and np.ndim(store["4"]) == 2
    if count == 7:
        return _LAYOUT_AFTER_0_2 if before_0_3 else _LAYOUT_0_4
    if count == 6:
        return _LAYOUT_0_2 if before_0_3 else _LAYOUT_0_3
    return None
