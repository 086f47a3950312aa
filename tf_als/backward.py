"""The backward pass of an instrumented model: per-layer scales, forks and
per-call unscaling, as custom-gradient identities around the original calls.

Scale bookkeeping. Every tensor t that receives a gradient carries a scale
T(t) relative to the global loss scale S; it is tracked as an integer
exponent, e(t) = log2 T(t), while the backward pass is traced:

    e(model output)      = 0
    e_in(point n)        = e_out(n) + log2 s_n          (s_n may be updated)
    e_in(weightless c)   = e_out(c)
    e_out(call)          = min over its outputs' e(t)   (outputs rescaled)
    e(t)                 = min over the consumers of t  (contributions rescaled)

Gradients run from the loss to the inputs, so when a call's gradient function
runs, every consumer of its outputs has already run and recorded its
exponent: the exponents are plain tensors handed from one gradient function to
the next through a `Backward` object made fresh for each forward pass (so
replicas and retraces never share one). A scaling point's weight gradients
are multiplied by 2**-e_in(n) in float32 inside its own gradient function, so
every variable receives exactly S times its true gradient, whichever calls it
came from; `keras.optimizers.LossScaleOptimizer` then divides by S.
"""

import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src import tree

from tf_als import _pow2
from tf_als import graph
from tf_als import policy


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

    def __init__(self, plan, points, find_controller):
        self.plan = plan
        self.points = points
        self._find_controller = find_controller
        self._slot_exponents = {}
        self._point_exponents = {}  # call index -> e_in of a scaling point
        self._call_exponents = {}  # call index -> e_out
        self._should_update = None

    @property
    def controller(self):
        if self._find_controller is not None:
            self._controller = self._find_controller()
            self._find_controller = None
        return self._controller

    # -- exponent bookkeeping (runs while the backward pass is traced) -----

    def slot_exponent(self, slot):
        """e(t) for the tensor in `slot`, or None if no gradient reaches it."""
        if slot in self._slot_exponents:
            return self._slot_exponents[slot]
        exponents = [
            self.edge_exponent(consumer)
            for consumer in self.plan.consumers.get(slot, ())
        ]
        exponent = _minimum(exponents)
        if exponent is not None:
            self._slot_exponents[slot] = exponent
        return exponent

    def edge_exponent(self, consumer):
        """The exponent of the gradient contribution `consumer` sends back."""
        kind = consumer[0]
        if kind in (graph.OUTPUT, graph.LOSS):
            return 0
        call = self.plan.calls[consumer[1]]
        if kind == graph.ENTER:
            return self.slot_exponent(call.outputs[consumer[2]])
        if call.point is not None:
            return self._point_exponents.get(call.index)
        return self.call_exponent(call)

    def call_exponent(self, call):
        """e_out of `call`: the minimum over its float outputs."""
        if call.index in self._call_exponents:
            return self._call_exponents[call.index]
        exponent = _minimum(
            [
                self.slot_exponent(slot)
                for slot in call.outputs
                if slot in self.plan.float_slots
            ]
        )
        if exponent is not None:
            self._call_exponents[call.index] = exponent
        return exponent

    def should_update(self):
        """Boolean tensor: does this step update the scales?"""
        if self._should_update is None:
            iterations = tf.convert_to_tensor(self.controller.iterations)
            interval = tf.constant(self.controller.update_interval, iterations.dtype)
            self._should_update = tf.equal(tf.math.floormod(iterations, interval), 0)
        return self._should_update

    # -- the three custom-gradient identities ------------------------------

    def fork(self, slot, x, count):
        """`count` copies of `x`, one per consumer of `slot`. Backward: each
        consumer's contribution is rescaled to the smallest consumer scale,
        then they are summed."""
        consumers = self.plan.consumers[slot]

        @tf.custom_gradient
        def fork(x):
            def grad(*upstream):
                exponents = [self.edge_exponent(c) for c in consumers]
                common = self.slot_exponent(slot)
                parts = [
                    _rescale(dy, _subtract(common, e))
                    for dy, e in zip(upstream, exponents)
                    if e is not None and dy is not None
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
        each output's gradient to the call's common (minimum) exponent, so
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
                common = self.call_exponent(call)
                result = []
                for i, dy in zip(floats, upstream):
                    e = self.slot_exponent(call.outputs[i])
                    result.append(
                        dy if e is None else _rescale(dy, _subtract(common, e))
                    )
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
        gradients are aligned to e_out, the scale s_n is (re)chosen on update
        steps, the gradients are multiplied by s_n, the layer's own backward
        runs, and its weight gradients are unscaled by 2**-e_in in float32.

        Returns the flat list of outputs.
        """
        flat_args = tree.flatten((args, kwargs))
        positions, xs = _float_tensors(flat_args)
        state = self.points[call.point]
        results = {}

        @tf.custom_gradient
        def scaled(*xs):
            flat = list(flat_args)
            for position, x in zip(positions, xs):
                for p in position:
                    original = flat[p]
                    if x is not original:
                        mask = keras_backend.get_keras_mask(original)
                        if mask is not None:
                            keras_backend.set_keras_mask(x, mask)
                    flat[p] = x
            call_args, call_kwargs = tree.pack_sequence_as((args, kwargs), flat)
            with tf.GradientTape() as tape:
                tape.watch(xs)
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
                exponents = [self.slot_exponent(s) for s in out_slots]
                common = self.call_exponent(call)
                if common is None:
                    common = 0
                upstream = [
                    dy if e is None else _rescale(dy, _subtract(common, e))
                    for dy, e in zip(upstream, exponents)
                ]
                scale = self._scale(state, upstream, common)
                exponent_in = _add(common, _pow2.floor_log2(scale))
                self._point_exponents[call.index] = exponent_in
                scaled_upstream = [
                    dy * tf.cast(scale, dy.dtype) for dy in upstream
                ]
                grads = tape.gradient(
                    ys, list(xs) + variables, output_gradients=scaled_upstream
                )
                input_grads = grads[: len(xs)]
                unscale = _pow2.pow2(-exponent_in)
                variable_grads = [
                    _unscale(g, unscale) for g in grads[len(xs) :]
                ]
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

    def _scale(self, state, upstream, exponent_out):
        """The scale to apply now: the stored one, or on update steps a new
        one chosen from the incoming gradient (and recorded)."""
        current = tf.convert_to_tensor(state.scale)
        if self.controller is None:
            return current
        controller = self.controller

        def update():
            statistics = policy.gradient_statistics(
                upstream, controller.underflow_rate
            )
            statistics = _across_replicas(statistics)
            scale = policy.choose_scale(
                statistics,
                current,
                controller.max_layer_scale,
                controller.overflow_margin,
            )
            exponent_in = _add(exponent_out, _pow2.floor_log2(scale))
            assigns = state.record(
                scale,
                _pow2.pow2(exponent_in),
                statistics,
                tf.convert_to_tensor(controller.iterations),
            )
            with tf.control_dependencies(assigns):
                return tf.identity(scale)

        return tf.cond(self.should_update(), update, lambda: tf.identity(current))


def _across_replicas(statistics):
    """Replicas must agree on every scale: take the max of percentile and
    amax and the mean of the fractions over all replicas."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return statistics
    percentile, amax = context.all_reduce(
        tf.distribute.ReduceOp.MAX, [statistics.percentile, statistics.amax]
    )
    fractions = context.all_reduce(
        tf.distribute.ReduceOp.MEAN,
        [
            statistics.zero_fraction,
            statistics.subnormal_fraction,
            statistics.near_max_fraction,
        ],
    )
    return policy.GradientStatistics(percentile, amax, *fractions)


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


def _minimum(exponents):
    present = [e for e in exponents if e is not None]
    if not present:
        return None
    if all(isinstance(e, int) for e in present):
        return min(present)
    result = present[0]
    for e in present[1:]:
        result = tf.minimum(result, e)
    return result


def _add(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    return tf.add(a, b)


def _subtract(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a - b
    return tf.subtract(a, b)


def _rescale(gradient, exponent):
    """gradient * 2**exponent, exact, computed in float32 (a factor below
    float16's range must not round to zero before it is applied)."""
    if isinstance(exponent, int) and exponent == 0:
        return gradient
    factor = _pow2.pow2(exponent)
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            _rescale(gradient.values, exponent),
            gradient.indices,
            gradient.dense_shape,
        )
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
