"""Where a backward pass turned non-finite: the one walk that both the storm
error (`storm`) and `tf_als.diagnose` use.

Gradients run from the loss to the inputs, so the scaling point to blame is
the first one, walking the plan's points from the loss, whose incoming
gradient is finite (or not known) but whose own backward pass is not: its
weight gradients are not finite, or the gradient it hands to the points that
feed it is not.
"""

from typing import Callable, Mapping, Optional

from tf_als._src.model import graph
from tf_als._src.failures import nonfinite


def first_non_finite(
    plan: graph.Plan,
    weights_finite: Callable[[int], bool],
    incoming_finite: Optional[Mapping[int, bool]] = None,
) -> Optional[nonfinite.Finding]:
    """The first scaling point, walking from the loss, whose backward pass
    turned the gradient non-finite; None when there is none. The
    `nonfinite.Finding` names the point (`point`), the layer it calls (by
    name), what is not finite (`nonfinite.WEIGHTS` or `nonfinite.INPUTS`)
    and the points it receives its gradient from (`receivers`; empty: it
    receives the loss's gradient directly).

    Args:
        plan: the instrumented model's `graph.Plan`.
        weights_finite: call index -> whether that point's weight gradients
            are all finite.
        incoming_finite: call index -> whether the gradient reaching that
            point is finite; None when not known (a point then counts as
            reached by a finite gradient, and only weight gradients decide).
    """
    names = {point.call: point.name for point in plan.points}
    for index in reversed(list(names)):
        if incoming_finite is not None and not incoming_finite[index]:
            continue
        call = plan.calls[index]
        what = None
        if not weights_finite(index):
            what = nonfinite.WEIGHTS
        elif incoming_finite is not None and any(
            not incoming_finite[feeder] for feeder in graph.upstream_points(plan, call)
        ):
            what = nonfinite.INPUTS
        if what is not None:
            return nonfinite.Finding(
                layer=call.operation.name,
                what=what,
                point=names[index],
                receivers=tuple(names[r] for r in receivers(plan, index)),
            )
    return None


def receivers(plan: graph.Plan, index: int) -> list:
    """Call indices of the scaling points whose input gradient reaches
    point call `index` (through weightless calls only)."""
    return [
        point.call
        for point in plan.points
        if index in graph.upstream_points(plan, plan.calls[point.call])
    ]
