"""The backward pass of an instrumented model: per-layer scales, forks and
per-call unscaling, as custom-gradient identities around the original calls.

Which scale each gradient carries is `algebra`'s business; this module
applies it. Gradients run from the loss to the inputs, so when a call's
gradient function runs, every consumer of its outputs has already run and
recorded its scale: the scales are plain tensors handed from one gradient
function to the next through a `Backward` object made fresh for each
forward pass (so replicas and retraces never share one). A scaling point's
weight gradients are divided by T_in(n) in float32 inside its own gradient
function, so every variable receives exactly S times its true gradient,
whichever calls it came from; the optimizer then divides by S, in the
same multiply where a variable's whole gradient is one call's product
(`unscaled`).

Each point chooses its scale inside its gradient function, from the
gradient it is about to scale (`choice.Choice`). What it chose and a
sample of what it saw go to the model's `pass_record.PassRecord`, which
the optimizer that applies the gradients writes into the state, with the
forward headroom of the point's float16 outputs (measured as soon as the
point has run, on telemetry steps only).

Each point's own backward runs on a persistent tape kept from the forward
pass, so the gradient function can run twice: once for a gradient the
step differentiates again (a gradient penalty's input gradient), once for
the outer gradient; both runs use the same scales.
"""

import functools

import tensorflow as tf
from keras import tree

from tf_als._src.model import _keras
from tf_als._src.model import hooks
from tf_als._src.training import algebra
from tf_als._src.training import choice
from tf_als._src.training import pass_record


class Backward:
    """Bookkeeping shared by the gradient functions of one forward pass.

    Args:
        plan: the model's `graph.Plan`.
        state: the model's `state.ScalingState` (row i: point i).
        unscaled: the model's `unscaled.UnscaledGradients`, which
            records the weight gradients this pass unscales (an optimizer
            applying them divides them by S in the same multiply).
        points: the model's `points.Point`s, in row order (of those, the
            ones that are not calls of the plan are run by `hooks` and
            `wrap_inner_call`).
        config, record, synchronized: what the points choose with, where
            they leave it, and which take T_in = 1 across replicas (see
            `choice.Choice`).
        training: whether the pass trains (the forward headroom is
            measured only then).
    """

    def __init__(
        self, plan, state, unscaled, points=(), config=None, record=None,
        synchronized=frozenset(), training=False,
    ):
        self.plan = plan
        self.training = bool(training)
        self.unscaled = unscaled
        self.record = pass_record.PassRecord() if record is None else record
        self.choice = choice.Choice(state, config, self.record, synchronized)
        self.carried = algebra.CarriedScales(plan)
        # (enclosing point, id(layer)) -> inner point index, and each inner
        # point's enclosing point (None for a subclassed model's root).
        inner = [p for p in points if p.call is None]
        self._inner = {(p.parent, id(p.layer)): p.index for p in inner}
        self._owners = {p.index: p.layer for p in points}
        self._parents = {p.index: p.parent for p in inner}
        self._interior = {}  # point -> T_in, the scale of its interior
        self._handled = {}  # point -> ids of variables unscaled inside it
        self._input_scales = {}  # point -> T its input gradients carry
        self._lifted = {}  # point -> whether its inputs are lifted

    # -- the three custom-gradient identities ------------------------------

    def fork(self, slot, x, count):
        """`count` copies of `x`, one per consumer of `slot`. Backward: each
        consumer's contribution is rescaled to the smallest consumer scale,
        then they are summed."""
        consumers = self.plan.consumers[slot]

        @tf.custom_gradient
        def fork(x):
            @_named("tf_als_fork")
            def grad(*upstream):
                scales = [self.carried.edge(c) for c in consumers]
                common = self.carried.slot(slot)
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
        for y in outputs:
            _keras.copy_mask(x, y)
        return outputs

    def enter(self, slot, x):
        """Identity on a model input in `slot` (a non-float input, such as
        token ids, is returned as it is). Backward: the input's
        gradient, which carries T(slot), brought back to T = 1 (the global
        scale alone, as the uninstrumented model gives it), exactly, in
        float32. What uses a model's input gradient sees no per-layer
        scale: a gradient penalty, or a GAN's generator behind its
        critic."""

        if not _is_float_tensor(x):
            return x

        @tf.custom_gradient
        def enter(x):
            @_named("tf_als_enter")
            def grad(dy):
                t = self.carried.slot(slot)
                return dy if t is None else _rescale(_dense(dy), 1.0, t)

            return tf.identity(x), grad

        y = enter(x)
        _keras.copy_mask(x, y)
        return y

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
            @_named("tf_als_align")
            def grad(*upstream):
                common = self.carried.call(call)
                result = []
                for i, dy in zip(floats, upstream):
                    t = self.carried.slot(call.outputs[i])
                    result.append(dy if t is None else _rescale(dy, common, t))
                return result

            return [tf.identity(x) for x in xs], grad

        aligned = align(*[outputs[i] for i in floats])
        outputs = list(outputs)
        for i, y in zip(floats, aligned):
            _keras.copy_mask(outputs[i], y)
            outputs[i] = y
        return outputs

    def wrap_call(self, call, function, args, kwargs):
        """Calls `function(*args, **kwargs)` (the layer) as a scaling point.

        Forward: the layer's outputs, untouched. Backward: the output
        gradients are aligned to T_out, s_n is chosen from them, they
        are multiplied by s_n, the layer's own backward
        runs, and its weight gradients are divided by T_in = s_n * T_out in
        float32.

        Returns the flat list of outputs.
        """

        def backward(tape, ys, xs, variables, upstream, floats, keys):
            with tf.name_scope("tf_als_align"):
                common = self.carried.call(call)
                common = 1.0 if common is None else common
                upstream = [
                    dy if t is None else _rescale(_dense(dy), common, t)
                    for dy, t in zip(
                        upstream, [self.carried.slot(call.outputs[i]) for i in floats]
                    )
                ]
            again = _keras.recorded_by_a_tape(list(xs) + list(variables))
            scale, scaled = self.choice.scaled(call.point, upstream, common, again)
            scale_in = scale * common
            self.carried.point_scales[call.index] = scale_in
            self._input_scales[call.point] = scale_in
            return self._inside(call.point, tape, ys, xs, variables, keys, scaled, scale_in)

        _, outputs = self._scaled_call(call.point, function, args, kwargs, backward)
        return outputs

    def inner_point_index(self, parent, layer):
        """The inner point a call of `layer` is when made inside point
        `parent`'s call, or None."""
        return self._inner.get((parent, id(layer)))

    def wrap_inner_call(self, point, function, args, kwargs):
        """Calls `function(*args, **kwargs)` (a hooked layer's own `call`)
        as inner scaling point `point`.

        Forward: the layer's outputs, untouched. Backward: the output
        gradients carry the scale T of the enclosing point's interior; they
        are multiplied by s_n (chosen from them), the layer's own
        backward runs, its weight gradients are divided by s_n * T in
        float32 and its input gradients by s_n (exact: a power of two, in
        float32), so every contribution inside the enclosing call carries
        the same scale T, whichever layer it came from (the common scale at
        every fork inside it).
        """
        parent = self._parents[point]

        def backward(tape, ys, xs, variables, upstream, floats, keys):
            upstream = [
                tf.zeros_like(y) if dy is None else _dense(dy)
                for y, dy in zip(ys, upstream)
            ]
            scale_out = self._interior.get(parent, 1.0)
            again = _keras.recorded_by_a_tape(list(xs) + list(variables))
            scale, scaled = self.choice.scaled(point, upstream, scale_out, again)
            scale_in = scale * scale_out
            self._input_scales[point] = scale_out
            input_grads, variable_grads = self._inside(
                point, tape, ys, xs, variables, keys, scaled, scale_in
            )
            with tf.name_scope("tf_als_rescale"):
                input_grads = [
                    None if g is None else _rescale(g, scale_out, scale_in)
                    for g in input_grads
                ]
            self._handled.setdefault(parent, set()).update(id(v) for v in keys)
            return input_grads, variable_grads

        structure, outputs = self._scaled_call(point, function, args, kwargs, backward)
        return tree.pack_sequence_as(structure, outputs)

    def _scaled_call(self, point, function, args, kwargs, backward):
        """Runs `function(*args, **kwargs)` inside a custom gradient over its
        float inputs, under a tape, as point `point` (hooked layers called
        inside become its inner points). The gradient is
        `backward(tape, ys, xs, variables, upstream, floats, keys)`: `ys`
        the float outputs (at positions `floats` of the flat outputs), `xs`
        the float inputs, `variables` the values read for variables `keys`.
        The point layer's own are read once, outside, and passed in.
        Returns `(structure, flat)`: the structure of the outputs, and the
        flat outputs with the float ones replaced by their identities."""
        flat = tree.flatten((args, kwargs))
        positions, xs = _float_tensors(flat)
        layer = self._owners.get(point)
        weights = _keras.trainable_weights(layer)
        values = [_keras.read_stored(v) for v in weights]
        results = {}
        lifted = _lifts(self._lifted, self._parents.get(point), point, xs + values)

        @tf.custom_gradient
        def scaled(*inputs):
            # The layer reads views of its inputs, made before the tape: a
            # gradient of this call's gradient (a penalty) reaches them
            # through the layer's forward ops, unscaled, and they lift it
            # to the scale the call's input gradients carry.
            count = len(inputs) - len(values)
            xs = [_lift(self._input_scales, point, x) if lifted else x for x in inputs[:count]]
            mapped = list(inputs[count:])
            call_args, call_kwargs = _substitute(args, kwargs, flat, positions, xs)
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(xs + mapped)
                with hooks.inside(self, point), _keras.reading(layer, weights, mapped):
                    outputs = function(*call_args, **call_kwargs)
            flat_outputs = tree.flatten(outputs)
            floats = [i for i, y in enumerate(flat_outputs) if _is_float_tensor(y)]
            results.update(outputs=outputs, floats=floats)
            ys = [flat_outputs[i] for i in floats]

            def grad(*upstream, variables=None):
                read = list(variables or [])
                grads, variable_grads = backward(
                    tape, ys, xs, mapped + read, list(upstream), floats,
                    keys=weights + read,
                )  # The mapped values' gradients leave as input gradients.
                grads = list(grads) + list(variable_grads[: len(mapped)])
                return grads, list(variable_grads[len(mapped) :])

            return ys, grad

        ys = scaled(*xs, *values)
        if not isinstance(ys, (list, tuple)):
            ys = [ys]
        halves = [y for y in ys if y.dtype == tf.float16]
        if self.training and halves:
            self.choice.measure_forward(point, halves)
        outputs = list(tree.flatten(results["outputs"]))
        for i, y in zip(results["floats"], ys):
            _keras.copy_mask(outputs[i], y)
            outputs[i] = y
        return results["outputs"], outputs

    def _inside(self, point, tape, ys, xs, variables, keys, scaled, scale_in):
        """The backward pass of a point's own call, from its incoming
        gradients already multiplied by its scale (`scaled`): input
        gradients (carrying `scale_in`) and variable gradients, each divided
        by `scale_in` in float32 unless an inner point inside the call
        already did (each product recorded in the step's
        `unscaled.UnscaledGradients`)."""
        self._interior[point] = scale_in
        grads = tape.gradient(ys, list(xs) + variables, output_gradients=scaled)
        handled = self._handled.get(point, set())
        with tf.name_scope("tf_als_unscale"):
            factor = 1.0 / scale_in  # A scalar: exact.
            variable_grads = [
                g if id(v) in handled else self.unscaled.unscale(g, factor)
                for v, g in zip(keys, grads[len(xs) :])
            ]
        if any(y.dtype == tf.float16 for y in ys):  # Sums that can overflow.
            self.record.put_products(
                point,
                tuple(
                    g for v, g in zip(keys, variable_grads)
                    if id(v) not in handled and g is not None
                ),
            )
        return grads[: len(xs)], variable_grads


def _named(scope):
    """Decorates a gradient function so that its ops are named under
    `scope` (`benchmarks/op_count.py` counts them by these names)."""

    def decorate(function):
        @functools.wraps(function)
        def named(*args, **kwargs):
            with tf.name_scope(scope):
                return function(*args, **kwargs)

        return named

    return decorate


def _lifts(lifted, parent, point, tensors) -> bool:
    """Whether point `point` lifts its inputs, recorded in `lifted`
    (point -> bool): only where a gradient of its gradient can be taken
    (`_keras.higher_order_possible` of its input and weight `tensors`),
    not under Keras's one first-order tape. An inner point follows its
    enclosing point `parent`, whose own tape (persistent, never
    differentiated twice) records its call."""
    if parent in lifted:
        lifted[point] = lifted[parent]
    else:
        lifted[point] = _keras.higher_order_possible(tensors)
    return lifted[point]


def _lift(scales, point, x):
    """Identity on input `x` of point `point`. Backward: times the scale
    the point's input gradients carry, which its gradient function
    recorded in `scales`; only a second-order gradient reaches here."""

    @tf.custom_gradient
    def lift(x):
        @_named("tf_als_lift")
        def grad(dy):
            t = scales.get(point)
            return dy if t is None else _rescale(_dense(dy), t, 1.0)

        return tf.identity(x), grad

    y = lift(x)
    _keras.copy_mask(x, y)
    return y


def _substitute(args, kwargs, flat, positions, xs):
    """`(args, kwargs)` with the float tensors at `positions` replaced by
    `xs` (their identities inside a custom gradient), masks carried over."""
    flat = list(flat)
    for position, x in zip(positions, xs):
        for p in position:
            original = flat[p]
            if x is not original:
                _keras.copy_mask(original, x)
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


def _rescale(gradient, target, current):
    """A gradient carrying scale `current` brought to scale `target`
    (<= current): times target/current, a power of two, so exact; computed
    in float32, since a factor below float16's range must not round to zero
    before it is applied."""
    if target is current:  # One scale, one object (a single consumer).
        return gradient
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


def _dense(gradient):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.convert_to_tensor(gradient)
    return gradient
