"""Which optimizer drives an instrumented model's scale updates.

The backward pass of an instrumented model needs the optimizer's step (is it
an update step?), and the optimizer's `apply` needs the model whose points
it updates. `model.compile(optimizer=...)` links the two directly. A custom
training loop has no compile step, so `AdaptiveLossScaleOptimizer.scale_loss`,
which every loop calls before taking gradients, announces itself here, and the
first backward pass of an unlinked instrumented model links to the optimizer
announced since its forward pass began. A link is for good: an optimizer
serves one model. Without a link, scales stay as they are.
"""

import itertools
import weakref

_serials = itertools.count(1)
_announced = (0, None)  # (serial, weakref to the optimizer)


def announce(optimizer):
    """Records `optimizer` as the one whose `scale_loss` ran last."""
    global _announced
    _announced = (next(_serials), weakref.ref(optimizer))


def serial():
    """The serial number of the latest announcement (0: none yet)."""
    return _announced[0]


def bind(model, optimizer):
    """Links `model` and `optimizer` (idempotent).

    Raises:
        ValueError: `optimizer` already drives another live model.
    """
    current = model_of(optimizer)
    if current is not None and current is not model:
        raise ValueError(
            f"Optimizer {optimizer.name!r} already drives the scale updates of "
            f"model {current.name!r}; it cannot also train {model.name!r}. "
            "Create one AdaptiveLossScaleOptimizer per model (each keeps its "
            "own step counter and loss scale)."
        )
    optimizer._tf_als_model = weakref.ref(model)
    model._tf_als_optimizer = weakref.ref(optimizer)


def model_of(optimizer):
    """The live model `optimizer` is linked to, or None."""
    linked = getattr(optimizer, "_tf_als_model", None)
    return linked() if linked is not None else None


def linked_optimizer(model):
    """The live optimizer `model` is linked to, or None (no announcement is
    taken)."""
    linked = getattr(model, "_tf_als_optimizer", None)
    return linked() if linked is not None else None


def optimizer_of(model, since):
    """The optimizer linked to `model`. A model without one links to the
    optimizer announced after serial `since` (taken when its forward pass
    began, so that an announcement left over from another model's step is
    never taken); `None` when there is neither."""
    linked = linked_optimizer(model)
    if linked is not None:
        return linked
    number, reference = _announced
    announced = reference() if reference is not None else None
    if announced is None or number <= since:
        return None
    bind(model, announced)
    return announced
