"""Which optimizer drives an instrumented model's scale updates.

The backward pass of an instrumented model needs the optimizer's step counter
and knobs. `model.compile(optimizer=...)` links the two directly. A custom
training loop has no compile step, so `AdaptiveLossScaleOptimizer.scale_loss`,
which every loop calls before taking gradients, announces itself here, and the
first backward pass of an unlinked instrumented model links to the optimizer
announced last. A link is for good: an optimizer serves one model.
"""

import weakref

_announced = None


def announce(optimizer):
    """Records `optimizer` as the one whose `scale_loss` ran last."""
    global _announced
    _announced = weakref.ref(optimizer)


def bind(model, optimizer):
    """Links `model` and `optimizer` (idempotent).

    Raises:
        ValueError: `optimizer` already drives another live model.
    """
    current = getattr(optimizer, "_tf_als_model", None)
    current = current() if current is not None else None
    if current is not None and current is not model:
        raise ValueError(
            f"Optimizer {optimizer.name!r} already drives the scale updates of "
            f"model {current.name!r}; it cannot also train {model.name!r}. "
            "Create one AdaptiveLossScaleOptimizer per model (each keeps its "
            "own step counter and loss scale)."
        )
    optimizer._tf_als_model = weakref.ref(model)
    model._tf_als_optimizer = weakref.ref(optimizer)


def controller(model):
    """The optimizer linked to `model`, linking to the announced one if the
    model has none yet; `None` when there is neither."""
    linked = getattr(model, "_tf_als_optimizer", None)
    linked = linked() if linked is not None else None
    if linked is not None:
        return linked
    announced = _announced() if _announced is not None else None
    if announced is None:
        return None
    bind(model, announced)
    return announced
