"""The scale algebra: which scale T every gradient of a plan carries.

Every tensor t that receives a gradient carries a scale T(t), a power of two
relative to the global loss scale S, as a float32 scalar:

    T(model output)      = 1
    T_in(point n)        = s_n * T_out(n)
    T_in(weightless c)   = T_out(c)
    T_out(call)          = min over its float outputs' T(t)
    T(t)                 = min over the consumers of t

A `CarriedScales` is filled with the T_in of each scaling-point call as it is
known; everything else follows from the plan. The backward pass fills it as
its gradient functions run (a point that no gradient reaches never runs and
stays unknown, so it constrains nothing). Products and ratios of powers of two are exact in float32.
"""

import tensorflow as tf

from tf_als._src.model import graph


class CarriedScales:
    """T of every slot and call of `plan`, from the points' T_in.

    Args:
        plan: a `graph.Plan`.

    Attributes:
        point_scales: call index of a scaling point -> its T_in (a float32
            scalar tensor or a Python float). Fill it before asking for
            the scale of anything upstream of that point.

    Example (a plan whose only point, the model output's producer, has
    T_in = 8):

    ```python
    carried = CarriedScales(plan)
    carried.point_scales[plan.points[0].call] = 8.0
    carried.slot(plan.input_slots[0])  # 8.0
    ```
    """

    def __init__(self, plan):
        self.plan = plan
        self.point_scales = {}
        self._slots = {}
        self._calls = {}

    def slot(self, slot):
        """T(t) for the tensor in `slot`, or None if no consumer is known."""
        if slot in self._slots:
            return self._slots[slot]
        scale = minimum([self.edge(c) for c in self.plan.consumers.get(slot, ())])
        if scale is not None:
            self._slots[slot] = scale
        return scale

    def edge(self, consumer):
        """The scale of the gradient contribution `consumer` sends back."""
        kind = consumer[0]
        if kind in (graph.MODEL_OUTPUT, graph.ADDED_LOSS):
            return 1.0  # T at the model outputs and the loss.
        call = self.plan.calls[consumer[1]]
        if kind == graph.ENTER:
            return self.slot(call.outputs[consumer[2]])
        if call.point is not None:
            return self.point_scales.get(call.index)
        return self.call(call)

    def call(self, call):
        """T_out of `call`: the minimum over its float outputs (None when
        none of them is known)."""
        if call.index in self._calls:
            return self._calls[call.index]
        scale = minimum(
            [
                self.slot(slot)
                for slot in call.outputs
                if slot in self.plan.float_slots
            ]
        )
        if scale is not None:
            self._calls[call.index] = scale
        return scale


def minimum(scales):
    """The minimum of the known scales (None entries are unknown), as a
    Python float when all are floats; None when none is known. One tensor
    given several times is taken once, so the minimum of one tensor is
    that tensor, and rescaling to it is no op at all (`backward._rescale`)."""
    present = list({id(t): t for t in scales if t is not None}.values())
    if not present:
        return None
    if all(isinstance(t, (int, float)) for t in present):
        return min(present)
    result = present[0]
    for t in present[1:]:
        result = tf.minimum(result, t)
    return result
