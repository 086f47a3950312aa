"""Which layer a failure promotes: the failing layer itself, or the
composite whose own code cannot take that layer's float32 output.

A promoted layer computes in float32 and returns float32. Between the
layers of a Functional or Sequential model that is harmless: each layer
casts its inputs to its own compute dtype, and Keras's ops promote a sum
of float16 and float32 to float32. Inside a composite's own `call`,
TensorFlow's operators do not: a KerasHub-style block that adds its
attention's output to its float16 residual (`x + self.attn(h)`) raises as
soon as the attention computes in float32. There the block is what has to
change, as an expert would give the block `dtype="float32"`, not the
attention alone: the failure moves up to it, and on, while the layer that
calls it cannot take its output either.

Trying re-runs the calling composite on the arguments the search
recorded, once per level, and only for a failing layer that a
composite's own code calls; nothing for the layers of a Functional model.
"""

import dataclasses
from typing import Optional

import keras

from tf_als._src.failures import nonfinite
from tf_als._src.failures import promote
from tf_als._src.model import _keras
from tf_als._src.model import graph


def placed(forward, failure) -> tuple:
    """`(failure, None)` with its layer moved to the composite that must
    be promoted for the model to run (`failure` itself when it can be
    promoted as it is), or `(None, why)` when only the model itself could
    take the failing layer's float32 output.

    Args:
        forward: the `backward_search.Forward` that found the failure (its
            calls tell which layer calls which; its batch is re-run).
        failure: a `preflight.Failure`.
    """
    layer = promote.layer_at(forward.model, failure.layer)
    if layer is None:
        return failure, None
    moved = probe = layer  # What to promote; whose callers to try.
    while True:
        caller = _caller(forward, probe)
        if caller is None:
            break
        error, changed = _run(forward, caller, moved)
        if error is not None and caller is forward.model:
            return None, (
                f"layer {failure.layer!r} fails in float16 "
                f"({failure.reason}), but its float32 output breaks the own "
                f"code of model {caller.name!r} that calls it ({error}), so it "
                "cannot be promoted alone; cast what that code combines with "
                "it, or compute the model in float32"
            )
        if error is not None:
            moved = probe = caller
        elif changed:
            probe = caller  # Its output is float32 now: try who calls it.
        else:
            break
    if moved is layer:
        return failure, None
    path = nonfinite.layer_path(moved)
    reason = (
        f"{failure.reason}; in {failure.layer!r}, whose float32 output "
        f"the own code of {path!r} cannot take"
    )
    return dataclasses.replace(failure, layer=path, reason=reason), None


def _caller(forward, layer) -> Optional[keras.layers.Layer]:
    """The layer whose own code calls `layer`: the innermost layer called
    in `forward` that holds it as a direct sublayer, unless that is a
    Functional or Sequential model (Keras casts between their layers);
    None then, or when none holds it."""
    holders = [
        called for called, _, _ in forward.own_calls
        if any(each is layer for each in _keras.sublayers(called, recursive=False))
    ]
    if not holders:
        return None
    caller = holders[0]  # Calls complete innermost first.
    return None if graph.is_flattenable(caller) else caller


def _run(forward, caller, layer) -> tuple:
    """`(error, changed)`: why `caller`, re-run on the arguments `forward`
    recorded for its first call with `layer` (its sublayers too) computing
    in float32, raises (None when it runs), and whether a float output of
    it then comes out in another dtype than it did. Variables are left as
    they were."""
    (args, kwargs), recorded = next(
        (arguments, outputs) for called, arguments, outputs in forward.own_calls
        if called is caller
    )
    try:
        with nonfinite.preserved(forward.model.variables):
            with _keras.dtype_policy(promote.layers_of(layer), "float32"):
                outputs = caller(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 (any error the switch causes)
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}", False
    before = [x.dtype for x in nonfinite.floats(recorded)]
    after = [x.dtype for x in nonfinite.floats(outputs)]
    return None, before != after
