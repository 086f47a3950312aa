"""Run-time routing of sublayer calls to inner scaling points.

`install(layer)` gives a layer an instance-level `call` that Keras's
`Operation.__call__` invokes after `Layer.__call__` has done its usual work
(input casting, masks, `training`, autocast). While an enclosing scaling
point runs (`inside(backward, point)`), the hooked call becomes an inner
scaling point of that forward pass; at any other time it is the layer's own
`call`, unchanged. The enclosing point is kept per thread, so replicas
tracing in parallel threads never see each other's passes.
"""

import contextlib
import threading
import types

_local = threading.local()


def _stack():
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextlib.contextmanager
def inside(backward, point: int):
    """Within this block, hooked layers called from `point`'s call become
    inner points of `backward` (a `backward.Backward`)."""
    stack = _stack()
    stack.append((backward, point))
    try:
        yield
    finally:
        stack.pop()


def install(layer) -> bool:
    """Routes `layer.call` through the hook (idempotent). Returns False, and
    leaves the layer alone, when its instance already replaces `call`."""
    current = vars(layer).get("call")
    if current is not None:
        return getattr(current, "__func__", None) is _hooked_call
    object.__setattr__(layer, "call", types.MethodType(_hooked_call, layer))
    return True


def _hooked_call(layer, *args, **kwargs):
    function = types.MethodType(type(layer).call, layer)
    stack = _stack()
    if stack:
        backward, parent = stack[-1]
        point = backward.inner_point_index(parent, layer)
        if point is not None:
            return backward.wrap_inner_call(point, function, args, kwargs)
    return function(*args, **kwargs)
