"""The first-batch check of a model whose class defines its own
`train_step` (keras.io's DDIM): the loss that step differentiates, read
from the step itself.

Such a step hands its unscaled loss to `optimizer.scale_loss` before it
differentiates and applies. `step_loss(model, optimizer)` runs the model's
own `train_step` on a batch, eagerly, and ends it there: `scale_loss`
raises with the loss it was given (`intercept`), so nothing after it runs
(no gradient applied, no metric or EMA update). The check
(`AdaptiveLossScaleOptimizer.preflight`, `step_loss=`) differentiates that
loss as it differentiates a `step_loss` the user writes, and puts back
what the forward pass moved.
"""

import keras


class Unchecked(Exception):
    """The model's own step could not give the check its loss (the
    message says why)."""


class _Captured(Exception):
    def __init__(self, loss):
        super().__init__("loss captured")
        self.loss = loss


class _Applied(Exception):
    pass


def intercept(optimizer, loss=None) -> None:
    """Called by the optimizer's `scale_loss` (with the loss) and `apply`
    (without one): while `step_loss` runs a model's own step, ends the step
    there; otherwise does nothing."""
    if not getattr(optimizer, "_tf_als_capturing", False):
        return
    if loss is None:
        raise _Applied()
    raise _Captured(loss)


def step_loss(model, optimizer):
    """`step_loss(batch)` for `optimizer.preflight`: the unscaled loss
    `model.train_step(batch)` hands `optimizer.scale_loss`.

    Raises `Unchecked` (from the returned function) when the step applies
    gradients without scaling its loss first, or returns without either.
    """

    def loss_of(batch):
        optimizer._tf_als_capturing = True
        try:
            model.train_step(batch)
        except _Captured as captured:
            return captured.loss
        except _Applied:
            raise Unchecked(
                f"the train_step of {type(model).__name__} {model.name!r} "
                "applies gradients without handing its loss to "
                "`optimizer.scale_loss` first"
            ) from None
        finally:
            optimizer._tf_als_capturing = False
        raise Unchecked(
            f"the train_step of {type(model).__name__} {model.name!r} "
            "returned without calling `optimizer.scale_loss`"
        )

    return loss_of


def packed(batches):
    """`batches` (a callable giving `(x, y, sample_weight)` triples) as the
    step receives them from `fit` (`keras.utils.pack_x_y_sample_weight`:
    `x` alone when there is nothing else)."""
    return lambda: (keras.utils.pack_x_y_sample_weight(*b) for b in batches())
