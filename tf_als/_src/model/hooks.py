"""Run-time routing of sublayer calls to inner scaling points.

`install(layer)` gives a layer an instance-level `call` that Keras's
`Operation.__call__` invokes after `Layer.__call__` has done its usual work
(input casting, masks, `training`, autocast). While an enclosing scaling
point runs (`inside(backward, point)`), the hooked call becomes an inner
scaling point of that forward pass; at any other time it is the layer's own
`call`, unchanged. The enclosing point is kept per thread, so replicas
tracing in parallel threads never see each other's passes.

Each install has an owner (an instrumented model's token) and a way back,
`uninstall(layer, owner)`; the last owner's uninstall deletes the instance
attribute, so the layer is exactly as it was.
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


def install(layer, owner) -> bool:
    """Routes `layer.call` through the hook for `owner` (any object: an
    instrumented model's token). Installing again for another owner only
    adds the owner. Returns False, and leaves the layer alone, when its
    instance replaces `call` with something else (the caller must then not
    rely on the hook)."""
    if vars(layer).get("call") is None:
        object.__setattr__(layer, "call", types.MethodType(_new_hook(), layer))
    owners = _owners(layer)
    if owners is None:
        return False
    owners.add(owner)
    return True


def uninstall(layer, owner) -> bool:
    """Undoes `owner`'s `install(layer, owner)`: once no owner is left, the
    layer's own `call` is back, as if it was never hooked. Returns whether
    the layer was hooked for `owner`."""
    owners = _owners(layer)
    if owners is None or owner not in owners:
        return False
    owners.discard(owner)
    if not owners:
        object.__delattr__(layer, "call")
    return True


def installed(layer) -> bool:
    """Whether `layer.call` goes through the hook."""
    return _owners(layer) is not None


def _owners(layer):
    """The owners of `layer`'s hook, or None when it has none."""
    function = getattr(vars(layer).get("call"), "__func__", None)
    return getattr(function, "tf_als_hook_owners", None)


def _new_hook():
    """A `call` for one layer (bound to it as a method) that knows who
    installed it."""

    def call(layer, *args, **kwargs):
        function = types.MethodType(type(layer).call, layer)
        stack = _stack()
        if stack:
            backward, parent = stack[-1]
            point = backward.inner_point_index(parent, layer)
            if point is not None:
                return backward.wrap_inner_call(point, function, args, kwargs)
        return function(*args, **kwargs)

    call.tf_als_hook_owners = set()
    return call
