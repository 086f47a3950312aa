"""Running a Sequential or Functional model's plan with its scaling points:
the same layer calls, in the same order, with the same arguments as
Keras's `Functional.call`, and the custom-gradient identities of a
`backward.Backward` around them (scales, forks, alignments)."""

from keras import tree

from tf_als._src.model import _keras
from tf_als._src.model import graph


def run(plan, back, inputs, training, mask):
    """Runs `plan` on `inputs` with the scaling points, forks and alignments
    of `back` (a `backward.Backward`), exactly as `Functional.call`
    runs the original graph."""
    top = graph.functional_of(plan.model)
    values, edges = {}, {}

    def bind(slot, tensor):
        values[slot] = tensor
        consumers = plan.consumers.get(slot, ())
        if slot in plan.float_slots and len(consumers) > 1:
            for consumer, copy in zip(
                consumers, back.fork(slot, tensor, len(consumers))
            ):
                edges[(slot, consumer)] = copy

    def value(slot, consumer):
        return edges.get((slot, consumer), values[slot])

    for slot, x in zip(plan.input_slots, _model_inputs(top, inputs, mask)):
        bind(slot, back.enter(slot, x))
    for call in plan.calls:
        for slot, y in zip(call.outputs, _run_call(call, value, back, training)):
            bind(slot, y)

    outputs = [
        value(slot, (graph.MODEL_OUTPUT, k)) for k, slot in enumerate(plan.output_slots)
    ]
    outputs = tree.pack_sequence_as(_keras.outputs_struct(top), outputs)
    if isinstance(outputs, (list, tuple)) and len(outputs) == 1:
        return outputs[0]
    return outputs


def _model_inputs(top, inputs, mask) -> list:
    """The model's flat inputs as `Functional.call` standardises them, with
    the masks given to the call attached."""
    flat_inputs = _keras.standardize_inputs(top, inputs)
    if mask is not None:
        for x, m in zip(flat_inputs, tree.flatten(mask)):
            if m is not None:
                _keras.set_mask(x, m)
    return flat_inputs


def _run_call(call, value, back, training) -> list:
    """The flat outputs of plan call `call`, its inputs read with
    `value(slot, consumer)`: a nested model's entry, a scaling point, or a
    weightless call with its outputs aligned."""
    if call.kind == graph.ENTER:
        flat = [
            value(slot, (graph.ENTER, call.index, position))
            for position, (_, slot) in enumerate(call.inputs)
        ]
        return _keras.enter_functional(call.operation, flat)
    key = (graph.CALL_INPUT, call.index)
    filled = {kid: value(slot, key) for kid, slot in call.inputs}
    args, kwargs = _keras.fill_in(call.node, filled)
    # `training`, the instrumented model's call's flag, against the one a
    # nested model was called with: as Keras has it (`graph._walk_nested`).
    if _keras.recorded_training_wins():
        context_training = training if call.training is None else call.training
    else:
        context_training = call.training if training is None else training
    function = _keras.operation_fn(call.operation, context_training)
    if call.point is not None:
        return back.wrap_call(call, function, args, kwargs)
    return back.align(call, tree.flatten(function(*args, **kwargs)))
