"""What each scaling point of one forward pass chooses: its scale, from
the gradient it is about to scale, and the forward headroom of its float16
outputs, both left in the model's `pass_record.PassRecord`.

The scale comes from the rule's own functions (`rule.amax_of`,
`rule.headroom` once per pass for every point, lowered by the gain its
weight gradients showed on its last steps, `rule.produced_headroom`;
`rule.scale_within`), with the knobs of the model's `config.ScalingConfig`
and the global scale's back-off and the gains from its state: one
max-reduction and a few scalar ops per point, no branch, and no variable
written; in a step traced without XLA, the scalar ops are one call per
point of a function XLA compiles once per process (`compiled_choice`).
Under the paper's rule (`rule="paper"`) a point re-chooses only when
the state says an update is due, and otherwise applies the scale in the
state. `backward.Backward` asks, and differentiates the point's call from
the scaled gradients.
"""

import functools

import tensorflow as tf

from tf_als._src.model import _keras
from tf_als._src.scaling import config as config_module
from tf_als._src.scaling import rule
from tf_als._src.scaling import tallies
from tf_als._src.training import compiled
from tf_als._src.training import pass_record
from tf_als._src.training import unscaled


class Choice:
    """The choices of one forward pass's scaling points.

    Args:
        state: the model's `state.ScalingState` (row i: point i).
        config: the `config.ScalingConfig` the points choose with (None:
            the defaults).
        record: the model's `pass_record.PassRecord`, where each point
            leaves its choice.
        synchronized: indices of the points whose own backward sums
            gradients across replicas (synchronized BatchNormalization):
            with several replicas their gradients must carry the same scale
            on every replica, so they take T_in = 1 there.
    """

    def __init__(self, state, config, record, synchronized=frozenset()):
        self.state = state
        self.config = config_module.ScalingConfig() if config is None else config
        self.record = record
        self.synchronized = frozenset(synchronized)
        self._used = {}  # point -> scale used in this pass
        self._limits = {}  # graph (None: eager) -> every point's headroom
        self._rows = {}  # graph (None: eager) -> the same, one tensor each
        self._forward = {}  # point -> its forward headroom, [2]
        self._due = {}  # graph (None: eager) -> telemetry step?
        self._kinds = {}  # outputs' dtypes -> `_branches`

    def scaled(self, point, upstream, scale_out, again=False):
        """`(s_n, upstream * s_n)`: the point's scale, chosen from
        `upstream`, the gradients it is about to scale (which carry
        `scale_out`), and recorded, and those gradients times it. A layer
        called several times inside one enclosing call is one inner point:
        the first of its calls to run backwards chooses.

        In a step traced without XLA, the scalar ops of one gradient's
        choice are one compiled call (`_compiled`); elsewhere, the rule's
        ops one by one.

        `again`: this backward pass runs under a tape that records it (a
        gradient penalty's inner gradient, of the unscaled score). Its
        gradients carry no global scale, so the rule would lift them S
        times too far, and the outer gradient of the penalty reaches the
        weights through them carrying S on top: T_in = 1, as Keras's
        plain pass (measured on WGAN-GP critics: up to 5 skipped steps
        where Keras skipped 1)."""
        if point in self._used:
            scale = self._used[point]
            return scale, _applied(upstream, scale)
        with tf.name_scope("tf_als_choice"):
            scale_out = tf.cast(scale_out, tf.float32)
            choose = self._compiled(point, upstream, again)
            if choose is not None:
                reduced = rule.amax_reduction(upstream[0])
                # `cast`: the scale in the gradient's dtype, cast inside.
                scale, cast, amax = choose(reduced, self._limit(point), scale_out)
            else:
                amax = rule.amax_of(upstream)
                scale = cast = self._choose(point, upstream, scale_out, amax, again)
            scaled = _applied(upstream, cast)
        with tf.name_scope("tf_als_sample"):
            samples = tuple(tallies.sample(dy) for dy in upstream)
        self.record.put(point, pass_record.PointRecord(scale, scale_out, amax, samples))
        self._used[point] = scale
        return scale, scaled

    def _compiled(self, point, upstream, again):
        """The compiled choice (`compiled_choice`) for point `point`'s
        `upstream`, or None where the rule's own ops serve: where
        `compiled.wanted` says no (eagerly, under XLA, where XLA does not
        run), for the paper's rule, a pass a tape records (`again`), a
        synchronized point (`_choose`) and a point with several
        gradients."""
        if (
            again
            or len(upstream) != 1
            or self.config.rule == "paper"
            or (point in self.synchronized and _replicas_in_sync() > 1)
            or not compiled.wanted()
        ):
            return None
        return compiled_choice(upstream[0].dtype, self.config.max_layer_scale)

    def _choose(self, point, upstream, scale_out, amax, again):
        """`scale`'s choice (float32 scalar), given the float32 `scale_out`
        and `amax` of `upstream`."""
        config = self.config
        if again:
            scale = 1.0 / scale_out  # A scalar: exact.
        elif point in self.synchronized and _replicas_in_sync() > 1:
            # Every replica chooses its own scales, so T_out differs between
            # them; a layer that sums its gradients across replicas inside
            # its own backward must see the same scale everywhere: T_in = 1,
            # the global scale alone, as Keras's (docs/distributed.md).
            scale = 1.0 / scale_out  # A scalar: exact.
        elif config.rule == "paper":
            current = row_of(tf.convert_to_tensor(self.state.scales), point)

            backoff = tf.convert_to_tensor(self.state.backoff)

            def update():
                return rule.choose_scale_paper(
                    upstream, current, config.max_layer_scale,
                    config.overflow_margin, config.underflow_rate, backoff,
                    scale_out,
                )

            due = tf.convert_to_tensor(self.state.due) > 0
            scale = tf.cond(due, update, lambda: current)
        else:
            scale = rule.scale_within(
                amax, self._limit(point), config.max_layer_scale, scale_out
            )
        return scale

    def _forward_headroom(self, outputs):
        """The forward headroom of a point's float16 `outputs`, as its
        `rule.forward_tallies`, measured only when the state says the
        coming step is a telemetry step (nothing read otherwise). Taken as
        soon as the point has run, from that point's outputs alone, so that
        no activation lives longer for it than the layers after the point
        need it.

        In a traced step each point adds one op: a branch (`StatelessIf`)
        whose two functions, measure or not, are traced once per pass for
        each kind of outputs (their dtypes; any shape) and shared by every
        point with that kind, so the step's library grows by two functions
        per kind (one kind, a float16 output, on most models), not per
        point, and a step without telemetry runs no read. The same code
        serves XLA, which compiles the branch as a conditional."""
        graph = unscaled.traced_graph()
        if graph not in self._due:
            self._due[graph] = tf.convert_to_tensor(self.state.telemetry_next) > 0
        due = self._due[graph]
        # Nothing differentiates a measurement.
        with _keras.unrecorded(), tf.name_scope("tf_als_forward"):
            if graph is None:
                return rule.forward_tallies(outputs if bool(due) else [])
            measure, skip = self._branches(outputs)
            return tf.raw_ops.StatelessIf(
                cond=due, input=list(outputs), Tout=[y.dtype for y in measure.outputs],
                then_branch=measure, else_branch=skip,
                output_shapes=[[], [], []], name="forward_headroom",
            )

    def _branches(self, outputs):
        """The two functions of `_forward_headroom`'s branch for outputs of
        the dtypes of `outputs` (of any shape): `rule.forward_tallies` of
        them, and of none; made once per pass and kind, and added to the
        graph being traced."""
        kind = tuple(y.dtype for y in outputs)  # Any shape, any rank.
        if kind not in self._kinds:
            specs = [tf.TensorSpec(None, dtype) for dtype in kind]
            self._kinds[kind] = tuple(
                tf.function(
                    lambda *ys, read=read: rule.forward_tallies(list(ys) if read else []),
                    input_signature=specs, autograph=False,
                ).get_concrete_function()
                for read in (True, False)
            )
        for function in self._kinds[kind]:
            function.add_to_graph()
        return self._kinds[kind]

    def finish(self) -> None:
        """At the end of a training forward pass: leaves each point's
        forward headroom (`measure_forward`) in the pass record for
        `update`."""
        if self._forward:
            self.record.put_forward(dict(self._forward))
        self._forward = {}

    def _headroom(self):
        """Every point's headroom in this pass ([points]), as bit patterns
        (`rule.bits_of`, int32): `rule.headroom` (the global scale's
        back-off is shared) lowered by the gain of its weight gradients
        (`rule.produced_headroom`), computed once per graph; each point
        takes its own row (`_limit`)."""
        graph = unscaled.traced_graph()
        if graph not in self._limits:
            backoff = tf.convert_to_tensor(self.state.backoff)
            limit = rule.headroom(self.config.overflow_margin, backoff)
            self._limits[graph] = rule.bits_of(rule.produced_headroom(
                limit, tf.convert_to_tensor(self.state.gains),
                self.config.overflow_margin,
            ))
        return self._limits[graph]

    def _limit(self, point):
        """Point `point`'s row of `_headroom` (a bit pattern). Under XLA,
        `row_of`; without it, every row comes from one op per pass
        (`tf.unstack`), where a row read by `row_of` took three ops per
        point."""
        limits = self._headroom()
        if _keras.compiled_by_xla():
            return row_of(limits, point)
        graph = unscaled.traced_graph()
        if graph not in self._rows:
            self._rows[graph] = tf.unstack(limits)
        return self._rows[graph][point]

    def measure_forward(self, point, outputs) -> None:
        """Measures the forward headroom of point `point`'s float16
        `outputs` (once per pass; `_forward_headroom`)."""
        if point not in self._forward:
            self._forward[point] = self._forward_headroom(outputs)


@functools.cache
def compiled_choice(dtype, max_layer_scale: float):
    """One XLA-compiled function from `(reduced, limit_bits, scale_out)` to
    `(s, s in dtype, amax)`: the scalar ops of a point's choice for a
    gradient of `dtype` whose `rule.amax_reduction` is `reduced`
    (`rule.amax_from_reduction`, then `rule.scale_within` with the limit
    as its bit pattern), and the scale cast for the multiply.

    Without XLA, TensorFlow dispatches each of those dozen-odd scalar ops
    on its own (a kernel launch each on a GPU); compiled, they are one
    call. The gradient's read and its multiply stay outside: every input
    is a scalar, so XLA compiles the function once per process and device
    whatever the gradients' shapes, and every point of every model with
    that dtype and ceiling calls it (a function of the gradient itself
    compiles once per shape: 5 s for a DenseNet121's 70 output shapes on
    a CPU).

    >>> choose = compiled_choice(tf.float16, 2.0**15)
    >>> reduced = rule.amax_reduction(tf.constant([1.0, -3.0], tf.float16))
    >>> scale, cast, amax = choose(reduced, rule.bits_of(16.0), tf.constant(1.0))
    >>> float(scale), cast.dtype.name, float(amax)
    (4.0, 'float16', 3.0)
    """

    def choose(reduced, limit_bits, scale_out):
        amax = rule.amax_from_reduction(reduced, dtype)
        scale = rule.scale_within(amax, limit_bits, max_layer_scale, scale_out)
        return scale, tf.cast(scale, dtype), amax

    # Every input is a scalar tensor of one dtype: one trace.
    return tf.function(choose, jit_compile=True, autograph=False)


def _applied(upstream, scale) -> list:
    """Each of `upstream` times `scale` (in its own dtype)."""
    with tf.name_scope("tf_als_apply"):
        return [dy * tf.cast(scale, dy.dtype) for dy in upstream]


def row_of(values, point: int) -> tf.Tensor:
    """Row `point` of `values`, a [points] vector of values >= 0 (scales,
    or the headroom's float32 bit patterns), taken by a max-reduction over
    a constant mask rather than by a slice.

    Under XLA a slice at a constant index fuses into every kernel that uses
    its value: each point's kernels then differ by their index, and layers
    of the same shape no longer share compiled kernels. Read by slices,
    the gains made ResNet50's step with XLA peak at 4108 MiB while
    compiling; read this way, 3584 (Keras's: 2499; docs/performance.md).
    A reduction stays a small kernel of its own, and the kernels that use
    its value are the same for every point of a shape.

    >>> float(row_of(tf.constant([4.0, 0.5, 2.0]), 1))
    0.5
    """
    values = tf.convert_to_tensor(values)
    mask = tf.one_hot(point, values.shape[0], on_value=True, off_value=False)
    return tf.reduce_max(tf.where(mask, values, tf.zeros_like(values)))


def _replicas_in_sync() -> int:
    context = tf.distribute.get_replica_context()
    return 1 if context is None else context.num_replicas_in_sync
