"""The backward pass of an instrumented model: per-layer scales, forks and
per-call unscaling, as custom-gradient identities around the original calls.

Scale bookkeeping. Every tensor t that receives a gradient carries a scale
T(t), a power of two relative to the global loss scale S, tracked as a
float32 scalar while the backward pass is traced:

    T(model output)      = 1
    T_in(point n)        = s_n * T_out(n)              (s_n may be updated)
    T_in(weightless c)   = T_out(c)
    T_out(call)          = min over its outputs' T(t)  (outputs rescaled)
    T(t)                 = min over the consumers of t (contributions rescaled)

Products and ratios of powers of two are exact in float32. Gradients run
from the loss to the inputs, so when a call's gradient function runs, every
consumer of its outputs has already run and recorded its scale: the scales
are plain tensors handed from one gradient function to the next through a
`Backward` object made fresh for each forward pass (so replicas and retraces
never share one). A scaling point's weight gradients are divided by
T_in(n) in float32 inside its own gradient function, so every variable
receives exactly S times its true gradient, whichever calls it came from;
`keras.optimizers.LossScaleOptimizer` then divides by S.
"""

import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src import tree

from tf_als import graph
from tf_als import hooks
from tf_als import policy
from tf_als import state as state_module


class Backward:
    """Bookkeeping shared by the gradient functions of one forward pass.

    Args:
        plan: the model's `tf_als.graph.Plan`.
        points: the `tf_als.state.ScalingPoint` of each scaling point.
        find_controller: called once, when the backward pass starts, to get
            the `AdaptiveLossScaleOptimizer` that decides when and how scales
            are updated (`None` keeps every scale fixed). It is looked up
            then, not at the forward pass, because a custom training loop
            links its optimizer in `scale_loss`, after the forward pass.
    """

    def __init__(self, plan, points, find_controller, inner=()):
        self.plan = plan
        self.points = points
        self._find_controller = find_controller
        # (enclosing point, id(layer)) -> inner point index, and each inner
        # point's enclosing point (see `tf_als.composite`).
        self._inner = {(i.parent, id(i.layer)): index for index, i in inner}
        self._parents = {index: i.parent for index, i in inner}
        self._interior = {}  # point -> T_in, the scale of its interior
        self._handled = {}  # point -> ids of variables unscaled inside it
        self._decided = {}  # point -> scale chosen in this pass
        self._slot_scales = {}
        self._point_scales = {}  # call index -> T_in of a scaling point
        self._call_scales = {}  # call index -> T_out
        self._step = None
        self._should_update = None
        self._backoff = None

    @property
    def controller(self):
        if self._find_controller is not None:
            self._controller = self._find_controller()
            self._find_controller = None
        return self._controller

    # -- scale bookkeeping (runs while the backward pass is traced) --------

    def slot_scale(self, slot):
        """T(t) for the tensor in `slot`, or None if no gradient reaches it."""
        if slot in self._slot_scales:
            return self._slot_scales[slot]
        scale = _minimum(
            [self.edge_scale(c) for c in self.plan.consumers.get(slot, ())]
        )
        if scale is not None:
            self._slot_scales[slot] = scale
        return scale

    def edge_scale(self, consumer):
        """The scale of the gradient contribution `consumer` sends back."""
        kind = consumer[0]
        if kind in (graph.OUTPUT, graph.LOSS):
            return 1.0
        call = self.plan.calls[consumer[1]]
        if kind == graph.ENTER:
            return self.slot_scale(call.outputs[consumer[2]])
        if call.point is not None:
            return self._point_scales.get(call.index)
        return self.call_scale(call)

    def call_scale(self, call):
        """T_out of `call`: the minimum over its float outputs."""
        if call.index in self._call_scales:
            return self._call_scales[call.index]
        scale = _minimum(
            [
                self.slot_scale(slot)
                for slot in call.outputs
                if slot in self.plan.float_slots
            ]
        )
        if scale is not None:
            self._call_scales[call.index] = scale
        return scale

    def step(self):
        """The optimizer's step counter (int64 tensor), read once per pass."""
        if self._step is None:
            self._step = tf.cast(
                tf.convert_to_tensor(self.controller.iterations), tf.int64
            )
        return self._step

    def should_update(self):
        """Boolean tensor: does this step update the scales?"""
        if self._should_update is None:
            interval = tf.constant(self.controller.update_interval, tf.int64)
            self._should_update = tf.equal(
                tf.math.floormod(self.step(), interval), 0
            )
        return self._should_update

    def backoff(self):
        """max(1, initial global scale / current global scale)."""
        if self._backoff is None:
            controller = self.controller
            initial = tf.constant(controller.initial_scale, tf.float32)
            if controller.built:
                current = tf.convert_to_tensor(controller.dynamic_scale)
                self._backoff = tf.maximum(1.0, initial / current)
            else:
                self._backoff = tf.constant(1.0)
        return self._backoff

    # -- the three custom-gradient identities ------------------------------

    def fork(self, slot, x, count):
        """`count` copies of `x`, one per consumer of `slot`. Backward: each
        consumer's contribution is rescaled to the smallest consumer scale,
        then they are summed."""
        consumers = self.plan.consumers[slot]

        @tf.custom_gradient
        def fork(x):
            def grad(*upstream):
                scales = [self.edge_scale(c) for c in consumers]
                common = self.slot_scale(slot)
                parts = [
                    _rescale(dy, common, t)
                    for dy, t in zip(upstream, scales)
                    if t is not None and dy is not None
                ]
                if not parts:
                    return tf.zeros_like(x)
                return tf.add_n([_dense(p) for p in parts])

            return [tf.identity(x) for _ in range(count)], grad

        outputs = fork(x)
        mask = keras_backend.get_keras_mask(x)
        if mask is not None:
            for y in outputs:
                keras_backend.set_keras_mask(y, mask)
        return outputs

    def align(self, call, outputs):
        """Identity on a weightless call's float outputs. Backward: rescales
        each output's gradient to the call's common (minimum) scale, so
        the call's own backward sums consistently scaled contributions."""
        floats = [
            i
            for i, slot in enumerate(call.outputs)
            if slot in self.plan.float_slots
        ]
        if len(floats) < 2:
            return outputs

        @tf.custom_gradient
        def align(*xs):
            def grad(*upstream):
                common = self.call_scale(call)
                result = []
                for i, dy in zip(floats, upstream):
                    t = self.slot_scale(call.outputs[i])
                    result.append(dy if t is None else _rescale(dy, common, t))
                return result

            return [tf.identity(x) for x in xs], grad

        aligned = align(*[outputs[i] for i in floats])
        outputs = list(outputs)
        for i, y in zip(floats, aligned):
            mask = keras_backend.get_keras_mask(outputs[i])
            if mask is not None:
                keras_backend.set_keras_mask(y, mask)
            outputs[i] = y
        return outputs

    def point(self, call, function, args, kwargs):
        """Calls `function(*args, **kwargs)` (the layer) as a scaling point.

        Forward: the layer's outputs, untouched. Backward: the output
        gradients are aligned to T_out, the scale s_n is (re)chosen on update
        steps, the gradients are multiplied by s_n, the layer's own backward
        runs, and its weight gradients are divided by T_in = s_n * T_out in
        float32.

        Returns the flat list of outputs.
        """
        flat_args = tree.flatten((args, kwargs))
        positions, xs = _float_tensors(flat_args)
        results = {}

        @tf.custom_gradient
        def scaled(*xs):
            call_args, call_kwargs = _substitute(
                args, kwargs, flat_args, positions, xs
            )
            with tf.GradientTape() as tape:
                tape.watch(xs)
                with hooks.inside(self, call.point):
                    outputs = function(*call_args, **call_kwargs)
            flat_outputs = tree.flatten(outputs)
            results["outputs"] = flat_outputs
            floats = [
                i for i, y in enumerate(flat_outputs) if _is_float_tensor(y)
            ]
            results["floats"] = floats
            ys = [flat_outputs[i] for i in floats]

            def grad(*upstream, variables=None):
                variables = list(variables or [])
                upstream = list(upstream)
                out_slots = [call.outputs[i] for i in floats]
                scales = [self.slot_scale(s) for s in out_slots]
                common = self.call_scale(call)
                if common is None:
                    common = 1.0
                upstream = [
                    dy if t is None else _rescale(_dense(dy), common, t)
                    for dy, t in zip(upstream, scales)
                ]
                scale = self._scale(call.point, upstream, common)
                scale_in = scale * common
                self._point_scales[call.index] = scale_in
                input_grads, variable_grads = self._inside(
                    call.point, tape, ys, xs, variables, upstream, scale, scale_in
                )
                return input_grads, variable_grads

            return ys, grad

        ys = scaled(*xs)
        if not isinstance(ys, (list, tuple)):
            ys = [ys]
        outputs = list(results["outputs"])
        for i, y in zip(results["floats"], ys):
            mask = keras_backend.get_keras_mask(outputs[i])
            if mask is not None:
                keras_backend.set_keras_mask(y, mask)
            outputs[i] = y
        return outputs

    def inner_point_of(self, parent, layer):
        """The inner point a call of `layer` is when made inside point
        `parent`'s call, or None."""
        return self._inner.get((parent, id(layer)))

    def inner_point(self, point, function, args, kwargs):
        """Calls `function(*args, **kwargs)` (a hooked layer's own `call`)
        as inner scaling point `point`.

        Forward: the layer's outputs, untouched. Backward: the output
        gradients carry the scale T of the enclosing point's interior; they
        are multiplied by s_n (re-chosen on update steps), the layer's own
        backward runs, its weight gradients are divided by s_n * T in
        float32 and its input gradients by s_n (exact: a power of two, in
        float32), so every contribution inside the enclosing call carries
        the same scale T, whichever layer it came from (the common scale at
        every fork inside it).
        """
        flat = tree.flatten((args, kwargs))
        positions, xs = _float_tensors(flat)
        parent = self._parents[point]
        results = {}

        @tf.custom_gradient
        def scaled(*xs):
            call_args, call_kwargs = _substitute(args, kwargs, flat, positions, xs)
            with tf.GradientTape() as tape:
                tape.watch(xs)
                with hooks.inside(self, point):
                    outputs = function(*call_args, **call_kwargs)
            flat_outputs = tree.flatten(outputs)
            floats = [i for i, y in enumerate(flat_outputs) if _is_float_tensor(y)]
            results.update(outputs=outputs, floats=floats)
            ys = [flat_outputs[i] for i in floats]

            def grad(*upstream, variables=None):
                upstream = [
                    tf.zeros_like(y) if dy is None else _dense(dy)
                    for y, dy in zip(ys, upstream)
                ]
                scale_out = self._interior.get(parent, 1.0)
                scale = self._scale(point, upstream, scale_out)
                scale_in = scale * scale_out
                input_grads, variable_grads = self._inside(
                    point, tape, ys, xs, list(variables or []), upstream,
                    scale, scale_in,
                )
                input_grads = [
                    None if g is None else _rescale(g, scale_out, scale_in)
                    for g in input_grads
                ]
                self._handled.setdefault(parent, set()).update(
                    id(v) for v in variables or []
                )
                return input_grads, variable_grads

            return ys, grad

        ys = scaled(*xs)
        if not isinstance(ys, (list, tuple)):
            ys = [ys]
        flat_outputs = list(tree.flatten(results["outputs"]))
        for i, y in zip(results["floats"], ys):
            flat_outputs[i] = y
        return tree.pack_sequence_as(results["outputs"], flat_outputs)

    def _inside(self, point, tape, ys, xs, variables, upstream, scale, scale_in):
        """The backward pass of a point's own call: the incoming gradients
        times `scale`, then input gradients (carrying `scale_in`) and
        variable gradients, each divided by `scale_in` in float32 unless an
        inner point inside the call already did."""
        self._interior[point] = scale_in
        scaled_upstream = [dy * tf.cast(scale, dy.dtype) for dy in upstream]
        grads = tape.gradient(
            ys, list(xs) + variables, output_gradients=scaled_upstream
        )
        handled = self._handled.get(point, set())
        unscale = tf.math.reciprocal(scale_in)
        variable_grads = [
            g if id(v) in handled else _unscale(g, unscale)
            for v, g in zip(variables, grads[len(xs) :])
        ]
        return grads[: len(xs)], variable_grads

    def _scale(self, point, upstream, scale_out):
        """The scale to apply now: the stored one, or on update steps a new
        one chosen from the incoming gradient (and recorded in the point's
        state). A layer called several times inside one enclosing call is
        one inner point: the first of its calls to run backwards decides,
        the others use that scale."""
        if point in self._decided:
            return self._decided[point]
        self._decided[point] = scale = self._choose(
            self.points[point], upstream, scale_out
        )
        return scale

    def _choose(self, state, upstream, scale_out):
        current = tf.convert_to_tensor(state.scale)
        controller = self.controller
        if controller is None:
            return current
        # Made outside the branch so that later points can reuse them.
        update, step, backoff = self.should_update(), self.step(), self.backoff()

        def measure():
            return policy.measure(upstream, controller.underflow_rate)

        if _replicas_in_sync() > 1:
            # Replicas must agree, so they exchange their measurements, and
            # not inside the branch below: Mirrored and MultiWorkerMirrored
            # strategies make a replica-context collective a `merge_call`
            # (unless XLA compiles for GPUs only), and a `merge_call` in a
            # `tf.cond` branch fails to trace ("`merge_call` called while
            # defining a new graph"). So each replica measures on update
            # steps (zeros otherwise) and the small vector is exchanged on
            # every step; the branch only uses the result. One replica
            # (the default strategy included) keeps the original path.
            measured = _across_replicas(
                tf.cond(
                    update,
                    measure,
                    lambda: tf.zeros([policy.MEASUREMENT_SIZE], tf.float32),
                )
            )
            measure = lambda: measured  # noqa: E731

        def choose_and_record():
            measurement = measure()
            statistics, histogram = policy.split_measurement(measurement)
            scale = policy.choose_scale(
                statistics,
                current,
                controller.max_layer_scale,
                controller.overflow_margin,
                backoff,
                scale_out,
            )
            record = state_module.record_vector(scale * scale_out, statistics)
            assigns = [
                state.scale.assign(scale),
                state.record.assign(record),
                state.histogram.assign(histogram),
                state.last_update.assign(step),
            ]
            with tf.control_dependencies(assigns):
                return tf.identity(scale)

        # Between updates the untaken branch costs a few skipped ops: the
        # statistics run out of line (see `policy.measure`).
        return tf.cond(update, choose_and_record, lambda: tf.identity(current))


def _replicas_in_sync():
    context = tf.distribute.get_replica_context()
    return 1 if context is None else context.num_replicas_in_sync


def _across_replicas(measurement):
    """Replicas must agree on every scale: take the max of percentile and
    amax and the mean of the fractions over all replicas (every replica
    holds an equal share of the global batch, so the mean of its fractions
    is the global batch's fraction).

    `tf.distribute.ReduceOp` has no MAX (only SUM and MEAN), so the vectors
    are all-gathered and reduced here; every replica reduces the same
    gathered values, so all get the same result. Called in a replica
    context with more than one replica in sync."""
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync
    gathered = context.all_gather(measurement[tf.newaxis], axis=0)
    gathered = tf.reshape(gathered, [replicas, policy.MEASUREMENT_SIZE])
    split = policy.MAXIMUM_ENTRIES
    maxima = gathered[:, :split]
    # A NaN amax (or percentile) on any replica stays NaN, as it would on a
    # single device (which keeps the scale); a max reduction may drop NaN.
    maxima = tf.where(
        tf.reduce_any(tf.math.is_nan(maxima), 0),
        tf.constant(float("nan")),
        tf.reduce_max(maxima, 0),
    )
    means = tf.reduce_mean(gathered[:, split:], 0)
    return tf.concat([maxima, means], 0)


def _substitute(args, kwargs, flat, positions, xs):
    """`(args, kwargs)` with the float tensors at `positions` replaced by
    `xs` (their identities inside a custom gradient), masks carried over."""
    flat = list(flat)
    for position, x in zip(positions, xs):
        for p in position:
            original = flat[p]
            if x is not original:
                mask = keras_backend.get_keras_mask(original)
                if mask is not None:
                    keras_backend.set_keras_mask(x, mask)
            flat[p] = x
    return tree.pack_sequence_as((args, kwargs), flat)


def _is_float_tensor(x):
    return tf.is_tensor(x) and x.dtype.is_floating


def _float_tensors(flat):
    """Distinct float tensors among `flat` and the positions of each."""
    positions, tensors, index = [], [], {}
    for p, x in enumerate(flat):
        if not _is_float_tensor(x):
            continue
        if id(x) in index:
            positions[index[id(x)]].append(p)
            continue
        index[id(x)] = len(tensors)
        positions.append([p])
        tensors.append(x)
    return positions, tensors


def _minimum(scales):
    present = [t for t in scales if t is not None]
    if not present:
        return None
    if all(isinstance(t, float) for t in present):
        return min(present)
    result = present[0]
    for t in present[1:]:
        result = tf.minimum(result, t)
    return result


def _rescale(gradient, target, current):
    """A gradient carrying scale `current` brought to scale `target`
    (<= current): times target/current, a power of two, so exact; computed
    in float32, since a factor below float16's range must not round to zero
    before it is applied."""
    if isinstance(target, float) and isinstance(current, float):
        if target == current:
            return gradient
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            _rescale(gradient.values, target, current),
            gradient.indices,
            gradient.dense_shape,
        )
    factor = tf.cast(target, tf.float32) / tf.cast(current, tf.float32)
    if gradient.dtype == tf.float32:
        return gradient * factor
    return tf.cast(tf.cast(gradient, tf.float32) * factor, gradient.dtype)


def _unscale(gradient, factor):
    """A weight gradient times `factor` (2**-e_in), in float32."""
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            _unscale(gradient.values, factor),
            gradient.indices,
            gradient.dense_shape,
        )
    result = tf.cast(gradient, tf.float32) * factor
    return tf.cast(result, gradient.dtype)


def _dense(gradient):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.convert_to_tensor(gradient)
    return gradient
