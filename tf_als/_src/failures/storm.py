"""Stopping a run whose steps are all being skipped (a non-finite storm).

Dynamic loss scaling skips a step and halves the global scale whenever a
gradient is not finite. When the cause is not the scale (NaN in the data, a
layer whose weights blew up), every step is skipped and the scale slides
towards zero without end. `AdaptiveLossScaleOptimizer(max_consecutive_skips=N)`
counts consecutive skips; this module turns the count and what the optimizer
recorded at the first skip of the streak into an error that names the layer
and says what to try, and holds the callback that raises it in `fit`.
"""

import itertools
from typing import Optional

import keras

from tf_als._src.model import _keras
from tf_als._src.failures import forward_search
from tf_als._src.failures import promote
from tf_als._src.failures import locate


class NonFiniteStormError(FloatingPointError):
    """Raised when `max_consecutive_skips` consecutive steps were skipped
    because their gradients were not finite. The message names the layer
    whose weight gradient was the first non-finite one (walking back from
    the loss) at the first skipped step, and what to try."""


def describe(optimizer, skips: int, attempted: Optional[int] = None) -> str:
    """The error message for `optimizer` after `skips` consecutive skips,
    `attempted` batches into training (None: not known)."""
    variables = _keras.optimizer_variables(optimizer)
    index, bad, loss_finite = (
        int(v) for v in keras.ops.convert_to_numpy(optimizer.first_non_finite)
    )
    scale = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
    applied = int(keras.ops.convert_to_numpy(optimizer.iterations))
    if attempted is None:
        where = f"after {applied} applied steps"
    else:
        where = f"at batch {attempted} ({applied} steps applied)"
    models = ", ".join(repr(m.name) for m in optimizer.applied_models())
    trains = f", training model {models}" if models else ""
    lines = [
        f"{skips} consecutive training steps were skipped because their "
        f"gradients were not finite (AdaptiveLossScaleOptimizer "
        f"{optimizer.name!r}{trains}, "
        f"max_consecutive_skips={optimizer.max_consecutive_skips}); the global "
        f"loss scale, halved at each, is down to {scale:g}, and training "
        f"stopped {where} instead of skipping forever."
    ]
    return " ".join(lines + _cause(optimizer, variables, index, bad, loss_finite))


def _cause(optimizer, variables, index, bad, loss_finite) -> list:
    """The sentences saying where the first skipped step turned non-finite
    and what to try, from the optimizer's record of that step."""
    if loss_finite == 0:
        return [
            "At the first skipped step the loss itself was not finite, so "
            "no loss scale can help: the forward pass overflowed float16, or "
            "the data holds NaN or inf. Run tf_als.diagnose(model, x, y) on "
            "a failing batch: it names the layer whose float16 arithmetic "
            "fails and how to put it in float32 (for a layer made of "
            "sublayers, theirs too: in Keras 3 a layer's dtype does not "
            "reach the sublayers its __init__ makes), or says that float32 "
            "fails too (check the data)."
        ]
    if not 0 <= index < len(variables):
        return [
            "Which layer's gradient was first non-finite was not recorded. "
            "Run tf_als.diagnose(model, x, y) on a batch of the failing data "
            "to find it."
        ]
    variable = variables[index]
    layer, after = _locate(optimizer, variable)
    return [
        f"At the first skipped step, walking back from the loss, the first "
        f"non-finite weight gradient was in layer {layer!r} (variable "
        f"{variable.path!r}); {bad} of {len(variables)} weight gradients were "
        "non-finite.",
        _advice(layer, after),
        "If the loss scale legitimately has to fall further, raise "
        "max_consecutive_skips (None disables this stop).",
    ]


def _advice(layer, after) -> str:
    """What to check when `layer`'s weight gradient was the first
    non-finite one, its incoming gradient coming from `after` (None: from
    the loss)."""
    if after is None:
        return (
            f"The gradient reaching {layer!r} comes straight from the loss: "
            "check the inputs and labels for NaN or inf (e.g. "
            "np.isfinite(x).all()), whether the loss overflows float32, and "
            f"the weights and outputs of {layer!r} for very large values."
        )
    return (
        f"The values became non-finite in the backward pass of {layer!r} "
        f"or in the gradient it received from {after}: check those "
        "layers' weights and activations for very large values (and the "
        "inputs for NaN or inf if every layer is affected), try a lower "
        "learning rate or gradient clipping (clipnorm= on the inner "
        "optimizer), and run tf_als.diagnose(model, x, y) on a failing "
        "batch."
    )


def _locate(optimizer, variable):
    """(the layer owning `variable`, the scaling points the gradient
    reaching it comes from, or None), named as `tf_als.scales` names points
    when the model is instrumented."""
    models = optimizer.applied_models()
    # Only an instrumented model has a plan (read by attribute: importing
    # `tf_als.instrument` here would close a cycle). The variable belongs
    # to the model whose trainable variables hold it.
    owner = [m for m in models if any(w is variable for w in m.trainable_variables)]
    plan = getattr(owner[0], "plan", None) if owner else None
    finding = None
    if plan is not None:
        # The record names one variable: the point to blame is the call
        # owning it closest to the loss (a shared layer has several).
        finding = locate.first_non_finite(
            plan,
            lambda index: not any(
                w is variable for w in plan.calls[index].operation.trainable_weights
            ),
        )
    if finding is None:
        return _layer_of(variable), _plain_after(optimizer, variable)
    after = ", ".join(repr(n) for n in finding.receivers) or None
    return finding.point, after


def _layer_of(variable):
    """The layer part of a variable's path ("dense_1/kernel" -> "dense_1")."""
    return variable.path.rsplit("/", 1)[0]


def _plain_after(optimizer, variable):
    """Without a plan: the layer of the next variable in training order, a
    stand-in for the layer after it (None for the last one)."""
    variables = _keras.optimizer_variables(optimizer)
    layer = _layer_of(variable)
    position = next(i for i, v in enumerate(variables) if v is variable)
    for later in variables[position + 1 :]:
        if _layer_of(later) != layer:
            return repr(_layer_of(later))
    return None


def _latest_first(batches, index, count=8):
    """`batches` (a callable, or None) as a callable giving the `count`
    batches up to `index` of the epoch, the latest first: the ones that
    may have just failed (with `steps_per_execution`, any of the last
    run), then the epoch's first ones."""
    if batches is None:
        return None

    def latest():
        recent = list(itertools.islice(batches(), max(0, index + 1 - count), index + 1))
        return itertools.chain(reversed(recent), batches())

    return latest


class NonFiniteGuard(keras.callbacks.Callback):
    """Stops `fit` with a `NonFiniteStormError` once an
    `AdaptiveLossScaleOptimizer` the fitted model trains has skipped
    `max_consecutive_skips` steps in a row (one variable read per batch and
    optimizer). Those optimizers are `optimizers`, or else the model's own
    (`model.optimizer`) and every one the model holds as an attribute (a
    list, tuple or dict of them too), as keras.io's GANs hold
    `self.d_optimizer` and `self.g_optimizer`.

    `fit` on a model returned by `tf_als.instrument` adds one on its own.
    Add it yourself to `fit` a plain model compiled with an
    `AdaptiveLossScaleOptimizer`, or a model whose own `train_step` applies
    instrumented models' gradients with optimizers it holds (a GAN). In a
    compiled custom training loop call `optimizer.check_skips()` after each
    step instead (an eager loop checks on its own).

    When the loss itself was not finite at the first skipped step, the
    guard re-runs the model eagerly on up to 8 batches of `inputs` (the
    training inputs) and adds to the error the first layer whose float16
    output is not finite. With `batches` (`(x, y, sample_weight)` training
    batches; `fit` on an instrumented model passes them), the optimizer can
    also re-run the backward pass with the model's compiled loss, to
    promote a layer whose backward pass fails (`promote_on_storm`).

    Args:
        inputs: optional; a callable returning an iterable of input
            batches (without targets) to re-run.
        batches: optional; a callable returning an iterable of
            `(x, y, sample_weight)` training batches (it supersedes
            `inputs`).
        optimizers: optional; the `AdaptiveLossScaleOptimizer`s to watch
            (a list), instead of those found on the model. Only the
            model's own optimizer re-runs batches (`inputs`, `batches`):
            the others' steps differentiate losses of the model's own
            `train_step`, which the guard cannot recompute.

    Example:

    ```python
    model.fit(x, y, callbacks=[tf_als.callbacks.NonFiniteGuard()])
    gan.fit(dataset, callbacks=[tf_als.callbacks.NonFiniteGuard()])
    ```
    """

    def __init__(self, inputs=None, batches=None, optimizers=None):
        super().__init__()
        for name, value in (("inputs", inputs), ("batches", batches)):
            if value is not None and not callable(value):
                raise TypeError(
                    f"`{name}` must be a callable returning batches, or "
                    f"None; received {type(value).__name__}."
                )
        if batches is not None:
            inputs = lambda: (b[0] for b in batches())  # noqa: E731
        self._input_batches = inputs
        self._training_batches = batches
        self._optimizers = None if optimizers is None else _checked_optimizers(optimizers)
        self._batches = 0

    def on_train_begin(self, logs=None):
        self._batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        own = getattr(self.model, "optimizer", None)
        watched = self._optimizers
        if watched is None:
            watched = adaptive_optimizers_of(self.model)
        for optimizer in watched:
            if optimizer is own:
                self._check_own(optimizer, batch)
            else:
                optimizer.check_skips(attempted=self._batches)

    def _check_own(self, optimizer, batch):
        """`check_skips` of the model's own optimizer, with the batches to
        re-run and the hint of a forward search."""
        check = optimizer.check_skips
        if self._training_batches is not None:
            batches, loss = self._training_batches, self._compiled_loss
        else:
            batches, loss = self._input_batches, None
        try:
            check(
                attempted=self._batches, batches=_latest_first(batches, batch), loss=loss
            )
        except NonFiniteStormError as error:
            hint = self._forward_hint(optimizer)
            if hint is None:
                raise
            raise NonFiniteStormError(f"{error} {hint}") from None

    def _compiled_loss(self, y, y_pred, sample_weight=None):
        return self.model.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)

    def _forward_hint(self, optimizer):
        loss_finite = int(keras.ops.convert_to_numpy(optimizer.first_non_finite)[2])
        rescued = optimizer.promote_on_storm and bool(optimizer.applied_models())
        if self._input_batches is None or loss_finite != 0 or rescued:
            return None
        model = _plain(self.model)  # the plain layers
        finding = forward_search.search(model, self._input_batches())
        if finding is None:
            return (
                "An eager re-run on training batches found every layer output "
                "finite (the failing batches, or dropout draws, differ)."
            )
        return (
            "An eager re-run on the training data found the first layer "
            f"whose float16 output is not finite: {finding.layer!r}. "
            + promote.advice(model, finding.layer, promoting=False)
        )


def adaptive_optimizers_of(model) -> list:
    """The `AdaptiveLossScaleOptimizer`s `model` trains: its own
    (`model.optimizer`) first, then those it holds as attributes (or in a
    list, tuple or dict attribute), by attribute name, each once."""
    found = []

    def add(value):
        if _is_adaptive(value) and all(
            value is not o for o in found
        ):
            found.append(value)

    add(getattr(model, "optimizer", None))
    for name in sorted(vars(model)):
        value = vars(model)[name]
        if isinstance(value, dict):
            value = list(value.values())
        for item in value if isinstance(value, (list, tuple)) else [value]:
            add(item)
    return found


def _checked_optimizers(optimizers) -> list:
    """`optimizers` as a list, each an `AdaptiveLossScaleOptimizer`."""
    if not isinstance(optimizers, (list, tuple)):
        raise TypeError(
            "`optimizers` must be a list of tf_als.AdaptiveLossScaleOptimizer "
            f"or None; received {type(optimizers).__name__}."
        )
    for optimizer in optimizers:
        if not _is_adaptive(optimizer):
            raise TypeError(
                "`optimizers` must hold tf_als.AdaptiveLossScaleOptimizer "
                f"instances; received {type(optimizer).__name__} "
                "(a Keras optimizer does not count skipped steps: wrap it, "
                "`tf_als.AdaptiveLossScaleOptimizer(optimizer)`)."
            )
    return list(optimizers)


def _is_adaptive(value) -> bool:
    """Whether `value` is an `AdaptiveLossScaleOptimizer` (known by its
    `check_skips`: the optimizer's module imports this one)."""
    return isinstance(value, keras.optimizers.Optimizer) and callable(
        getattr(value, "check_skips", None)
    )


def _plain(model):
    """The layers of `model` without scaling points: an instrumented
    model's `uninstrumented()`, any other model itself."""
    uninstrumented = getattr(model, "uninstrumented", None)
    return model if uninstrumented is None else uninstrumented()
