"""Before a step is lost: the layers whose float16 arithmetic fails on a
real batch, and the global loss scale a step can apply with.

`fit` on an instrumented model runs `check` on its first batch before the
first step; `AdaptiveLossScaleOptimizer.check_skips` runs it in a custom
loop that hands it batches and the loss, and after every promotion made on
a storm of skipped steps. All of it is eager, on the plain layers, and
leaves every variable of the model as it found it (BatchNormalization's
statistics, seeds, and weights a layer assigns in its own `call`, as
`SpectralNormalization` does), so the first step starts where Keras's
would:

1. **Forward.** The batch runs once in the model's precision; then every
   leaf layer that computes in float16 runs again in float32 on the very
   inputs it received (a Keras layer whose float16 output is finite is
   not: Keras accumulates and takes statistics in float32; nor is a
   weightless layer that draws at random with a finite output, whose
   re-run would draw anew). It fails when its float16 output is not finite
   while float32's is (a hand-written log-softmax's `exp` past 11.09), or
   strays from float32's by more than `RELATIVE_ERROR` of float32's
   largest magnitude (a hand-written
   normalisation whose float16 count overflowed reads a mean and variance
   of 0: finite, and wrong). When no leaf fails, a composite layer (one
   with sublayers, below the model) is re-run the same way, its sublayers
   in float32 too: it fails in its own code between its sublayers. A
   model output computed in float16 fails when
   its targets reach float16's maximum over `TARGET_FACTOR`: it has to reach
   them.
2. **Backward.** The loss's gradients at a global scale of 1. When they
   are not finite, the layer whose float16 backward pass turns a finite
   gradient into a non-finite one even at `rule.MIN_SCALE` fails
   (`backward_search`), and so does a float16 model output whose
   gradient from the loss fits float16 only at a scale below 1.
   Then, before the first step and after a promotion, the global scale S
   is chosen: the largest power of two at most the initial scale at which
   the gradients are finite (`largest_finite_scale`, down to `rule.MIN_SCALE`).
3. Failing layers are promoted (`promote`), every one found at
   once, and the check runs again, until nothing fails or the cap on
   failures is reached; then S is set.

A healthy model costs one eager forward pass, one float32 re-run of each
leaf layer not from Keras and one backward pass (at the initial scale) on
one batch, once. When the initial scale overflows, two more backward
passes on the same forward pass usually suffice (at 1, and at the scale
the gradients measured there allow); a bisection follows only when that
one overflows inside a layer.
"""

import contextlib
import dataclasses
import math
from typing import Callable, Iterable, Optional

import keras
import tensorflow as tf

from tf_als._src.model import _keras
from tf_als._src.failures import backward_search
from tf_als._src.failures import nonfinite
from tf_als._src.failures import placement
from tf_als._src.failures import promote
from tf_als._src.scaling import rule

# A float16 layer output may stray from the float32 re-run of the same
# layer on the same inputs by this share of the re-run's largest magnitude.
# Float16 rounds to 2**-11; a layer's own accumulation adds a few ulps of
# its output's range; a count that overflowed (a mean read as 0) is off by
# the whole range.
RELATIVE_ERROR = 2.0**-4
# A float16 model output fails when its targets reach rule.FLOAT16_MAX / this:
# half of float16's range leaves too little for the layer's own sums on the
# way (a Dense adds its bias to a product that may pass the result).
TARGET_FACTOR = 2.0


@dataclasses.dataclass(frozen=True)
class Failure:
    """A layer call that fails in float16 on the batch.

    Attributes:
        layer: the layer's path.
        reason: why, in words (`promote.Promotion.reason`).
    """

    layer: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What `check` did.

    Attributes:
        promotions: the `promote.Promotion`s made, in order.
        scale: the global scale chosen (None: the batch's gradients are not
            finite at any scale, or the loss itself is not).
        stopped: why a failure was left unpromoted (the cap, or a failure
            no promotion can help), or None.
        gains: `{id(layer): gain}` measured where the scale was chosen
            (`backward_search.Forward.gains`), for the scaling points'
            first step; empty when no scale was.
    """

    promotions: tuple
    scale: Optional[float]
    stopped: Optional[str]
    gains: dict = dataclasses.field(default_factory=dict)


def run(
    model: keras.Model,
    batches: Iterable,
    loss_fn: Optional[Callable],
    scale: float,
    step: int,
    choose: bool = False,
) -> Outcome:
    """`check` on each of `batches` in turn, until one has a failure to
    promote; the outcome's scale is chosen on that batch, or with `choose`
    on the first batch when none had one (None without `loss_fn`). The
    batches that pass cost a forward pass, the float32 re-runs and one
    backward pass each (three when the initial scale overflows)."""
    chosen, gains, first = None, {}, True
    for batch in batches:
        outcome = check(model, batch, loss_fn, scale, step, choose=choose and first)
        if outcome.promotions and outcome.scale is None and loss_fn is not None:
            # Stopped after a promotion: S for the model as it was left.
            forward = backward_search.Forward(model.uninstrumented(), batch, loss_fn)
            outcome = dataclasses.replace(
                outcome, scale=largest_finite_scale(forward, scale), gains=forward.gains()
            )
        if outcome.promotions or outcome.stopped is not None:
            return outcome
        if first:
            chosen, gains = outcome.scale, outcome.gains
        first = False
    return Outcome((), chosen, None, gains)


def check(
    model: keras.Model,
    batch: tuple,
    loss_fn: Optional[Callable],
    scale: float,
    step: int,
    training: bool = True,
    choose: bool = True,
) -> Outcome:
    """Finds and promotes the layers of `model` whose float16 arithmetic
    fails on `batch`, then finds the largest power of two at most `scale`
    at which the batch's gradients are finite.

    Args:
        model: the instrumented model (its plain layers are run).
        batch: `(x, y, sample_weight)`.
        loss_fn: `loss_fn(x, y, y_pred, sample_weight)`, the scalar loss,
            or a `backward_search.StepLoss` (then `batch` is the step's
            own); None checks the forward pass only.
        scale: the global scale to start from (the optimizer's initial
            scale).
        step: the optimizer step, for the promotions' record.
        training: the `training` argument of the forward pass.
        choose: whether to choose the scale when nothing was promoted
            (False: the outcome's scale is None); after a promotion it is
            always chosen.

    Returns:
        An `Outcome`.

    Example:

    ```python
    outcome = tf_als.preflight.check(model, (x, y, None), loss_fn,
                                     scale=2.0**15, step=0)
    outcome.promotions  # (Promotion(layer='price', ...),)
    outcome.scale       # 0.0001220703125
    ```
    """
    made, previous = [], {}
    top = math.floor(math.log2(scale))
    while True:
        forward = backward_search.Forward(model.uninstrumented(), batch, loss_fn, training)
        failures, at_top, unplaced = _failures(forward, loss_fn, 2.0**top)
        if unplaced is not None:
            return Outcome(tuple(made), None, unplaced)
        again = [f for f in failures if f.layer in previous]
        if again:
            return _taken_back(model, made, previous, again[0])
        if failures:
            new, stopped = promote.promote_all(model, failures, step, previous)
            made.extend(new)
            if stopped is not None or not new:
                return Outcome(tuple(made), None, stopped)
            continue
        chosen = None
        if (choose or made) and loss_fn is not None:
            chosen = 2.0**top if at_top is None else largest_finite_scale(forward, scale)
        gains = forward.gains() if chosen is not None else {}
        return Outcome(tuple(made), chosen, None, gains)


def failing_layers(
    model: keras.Model,
    batch: tuple,
    loss_fn: Optional[Callable],
    scale: float,
    training: bool = True,
) -> list:
    """The `Failure`s `check` finds on `batch`, in the order it promotes
    them, without promoting: each round's layers compute in float32 (a
    composite with its sublayers, `promote.layers_of`) for the rounds after
    it, as after a promotion, and every policy is back on return. `model`
    is plain. `tf_als.diagnose` names these, so that it, the first-batch
    check and the storm path give one answer. At most
    `promote.MAX_FAILURES` rounds."""
    found = []
    top = 2.0 ** math.floor(math.log2(scale))
    with contextlib.ExitStack() as switched:
        for _ in range(promote.MAX_FAILURES):
            forward = backward_search.Forward(model, batch, loss_fn, training)
            failures, _, unplaced = _failures(forward, loss_fn, top)
            if unplaced is not None:
                break
            failures = [f for f in failures if f.layer not in {g.layer for g in found}]
            layers = [promote.layer_at(model, f.layer) for f in failures]
            if not failures or None in layers:
                break
            found += failures
            for layer in layers:
                switched.enter_context(
                    _keras.dtype_policy(promote.layers_of(layer), "float32")
                )
    return found


def batch_mean_loss(loss: Callable) -> Callable:
    """`loss(y, y_pred[, sample_weight=])` as the `loss_fn` the checks take,
    `(x, y, y_pred, sample_weight) -> scalar`, reduced to the batch mean
    in float32 as `compile` reduces a per-sample loss."""

    def loss_fn(x, y, y_pred, sample_weight):
        if sample_weight is None:
            value = loss(y, y_pred)
        else:
            value = loss(y, y_pred, sample_weight=sample_weight)
        return tf.reduce_mean(tf.cast(value, tf.float32))

    return loss_fn


def _failures(forward, loss_fn, top) -> tuple:
    """(the `Failure`s of the batch's forward and backward passes, each
    moved to the layer that can be promoted for it (`placement`), the
    backward finding at the scale `top` or None, why a failure cannot be
    promoted or None). Finite at `top`, the backward pass is finite below
    it too (a smaller scale can only underflow), so nothing fails
    backward."""
    failures, at_top = _forward_failures(forward, loss_fn), None
    if not failures and loss_fn is not None:
        at_top = forward.at(top)
        failures = backward_failures(forward) if at_top is not None else []
    placed = []
    for failure in failures:
        moved, why = placement.placed(forward, failure)
        if why is not None:
            return [], at_top, why
        placed.append(moved)
    return _unique(placed), at_top, None


def _taken_back(model, made, previous, finding) -> Outcome:
    """The layer of `finding` was promoted by this check and fails the same
    way in float32: its promotion is undone."""
    promote.undo(model, finding.layer, previous[finding.layer])
    kept = tuple(p for p in made if p.layer != finding.layer)
    return Outcome(
        kept,
        None,
        f"layer {finding.layer!r} is not finite in float32 either "
        f"({finding.reason}), so promoting it cannot help",
    )


def forward_failures(
    model: keras.Model,
    batch: tuple,
    training: bool = True,
    loss_fn: Optional[Callable] = None,
) -> list:
    """The `Failure`s of `model`'s float16 forward pass on `batch` (see the
    module's docstring), and with `loss_fn`, of its loss; [] when none
    fails."""
    forward = backward_search.Forward(model, batch, loss_fn, training)
    return _forward_failures(forward, loss_fn)


def _forward_failures(forward, loss_fn) -> list:
    """`forward_failures` of a `backward_search.Forward` (the float32
    re-runs leave the model as they found it)."""
    failures = []
    with nonfinite.preserved(forward.model.variables):
        for layer, arguments, outputs in forward.own_calls:
            if _checked(layer, outputs):
                reason = _stray(layer, arguments, outputs)
                if reason is not None:
                    failures.append(Failure(nonfinite.layer_path(layer), reason))
        if not failures:
            failures += _composite_failures(forward)
    failures += _unreachable_targets(forward.calls, forward.y_pred, forward.targets)
    if loss_fn is not None and not forward.from_step and not failures:
        # A `StepLoss` computes its loss from the batch, not from outputs
        # that could be handed over in float32.
        failures += _loss_overflows(forward, loss_fn)
    return _unique(failures)


def clean_in_float32(model: keras.Model, batches: Iterable, loss_fn) -> bool:
    """Whether `model` (plain), every layer computing in float32, gives
    each of `batches` a finite loss and finite gradients (with `loss_fn`
    None, finite outputs). Then a failure those batches show in float16 is
    float16's, not the data's. Leaves the model as it found it."""
    with _keras.dtype_policy(_keras.all_layers(model), "float32"):
        for batch in batches:
            forward = backward_search.Forward(model, batch, loss_fn)
            if loss_fn is None and not nonfinite.all_finite(forward.y_pred):
                return False
            if loss_fn is not None and forward.at(1.0) is not None:
                return False
    return True


def _loss_overflows(forward, loss_fn) -> list:
    """When the loss on the float16 model outputs differs from the loss on
    the same outputs cast to float32 (exactly), by more than
    `RELATIVE_ERROR` or in finiteness, the `Failure`s of the layers that
    produce the float16 outputs: the user's loss sums them in float16 (a
    soft-Dice over a batch of maps reads 1.0, and every gradient 0)."""
    x, y, sample_weight = forward.batch
    outputs = [o for o in nonfinite.floats(forward.y_pred) if o.dtype == tf.float16]
    if not outputs:
        return []
    got = float(forward.loss)
    want = float(loss_fn(x, y, _to_float32(forward.y_pred), sample_weight))
    if not math.isfinite(want):
        return []
    if math.isfinite(got) and abs(got - want) <= RELATIVE_ERROR * max(abs(want), 1e-30):
        return []
    failures = []
    for output in outputs:
        producer = _producer(forward.calls, output)
        if producer is not None:
            failures.append(
                Failure(
                    nonfinite.layer_path(producer),
                    f"{promote.LOSS_DEPARTS} ({got:.4g} against {want:.4g}: the loss "
                    "sums or squares float16 outputs past 65504)",
                )
            )
    return failures


def _composite_failures(forward) -> list:
    """The composite layers (below the model) whose float16 output fails
    against their float32 re-run, sublayers included, while their inputs
    are finite (`_stray`): the failure is in the composite's own code
    between its sublayers, since no sublayer failed. GPT-2's attention
    masked with 1e10 (inf in float16) is not finite; a normalisation
    written in a composite's `call` whose float16 variance overflowed
    reads 0 and strays. Innermost first; a composite that holds a failing
    one is not blamed again. A finite output counts only where nothing in
    the composite draws at random (`_keras.draws_random`: a dropout inside
    would draw anew in the re-run) and the composite is not Keras's or
    KerasHub's (`_stray`)."""
    failed = []
    for layer, arguments, outputs in forward.own_calls:
        if (
            layer is forward.model
            or layer.compute_dtype != "float16"
            or not _keras.sublayers(layer, recursive=False)
            or (
                nonfinite.all_finite(outputs)
                and (_from_keras(layer) or _keras.draws_random(layer))
            )
        ):
            continue
        inner = {id(l) for l in _keras.sublayers(layer, recursive=True)}
        if any(id(f) in inner for f, _ in failed):
            continue
        reason = _stray(layer, arguments, outputs, promote.layers_of(layer))
        if reason is not None:
            failed.append((layer, reason))
    return [
        Failure(nonfinite.layer_path(l), _in_own_code(reason)) for l, reason in failed
    ]


def _in_own_code(reason) -> str:
    """A composite's reason: `promote.COMPOSITE` for a non-finite output,
    else the stray's, said to come from its own code."""
    if reason == promote.FORWARD:
        return promote.COMPOSITE
    return f"{reason}, from its own code between its sublayers"


def _checked(layer, outputs) -> bool:
    """A leaf layer that computes in float16: one with weights; one
    without that is not Keras's or KerasHub's (whose weightless layers
    the check has never re-run: a few reductions each on every pass of
    a search, hundreds on EfficientNet), unless its output is finite and
    it draws at random (its re-run would not draw the same)."""
    if _keras.sublayers(layer, recursive=False) or layer.compute_dtype != "float16":
        return False
    if layer.weights:
        return True
    if _from_keras(layer):  # Keras's own weightless layers: as before.
        return False
    return not nonfinite.all_finite(outputs) or not _keras.draws_random(layer)


def _stray(layer, arguments, outputs, switched=None) -> Optional[str]:
    """Why `layer`'s float16 `outputs` fail against its float32 re-run on
    the same `arguments`, with the layers `switched` (default: `layer`)
    computing in float32; None when they do not (or its inputs are not
    finite: a layer upstream failed first)."""
    args, kwargs = arguments
    if not nonfinite.all_finite((args, kwargs)):
        return None
    if nonfinite.all_finite(outputs) and _from_keras(layer):
        # Keras's own layers accumulate in float32 (matmuls, convolutions)
        # and compute normalisation statistics in float32: a finite float16
        # output of theirs is float32's, rounded. Layers written elsewhere
        # (hand-written statistics) are run again.
        return None
    with _keras.dtype_policy(switched or [layer], "float32"):
        expected = layer(*_to_float32(args), **_to_float32(kwargs))
    got, want = nonfinite.floats(outputs), nonfinite.floats(expected)
    if len(got) != len(want) or not nonfinite.all_finite(want):
        return None
    if not nonfinite.all_finite(got):
        return promote.FORWARD
    error, largest = 0.0, 0.0
    for a, b in zip(got, want):
        b = tf.cast(b, tf.float32)
        error = max(error, float(tf.reduce_max(tf.abs(tf.cast(a, tf.float32) - b))))
        largest = max(largest, float(tf.reduce_max(tf.abs(b))))
    if largest > 0 and error > RELATIVE_ERROR * largest:
        return (
            f"{promote.STRAYS} (by {error / largest:.0%} of its largest "
            "value: a float16 sum or count that overflowed, or a statistic "
            "that reads 0)"
        )
    return None


def _producer(calls, output):
    """The innermost layer of `calls` (in completion order) whose outputs
    include the tensor `output`, or None."""
    return next(
        (layer for layer, _, out in calls
         if any(o is output for o in keras.tree.flatten(out))),
        None,
    )


def _from_keras(layer) -> bool:
    return type(layer).__module__.split(".")[0] in ("keras", "keras_hub")


def _unreachable_targets(calls, y_pred, y) -> list:
    """Float16 model outputs whose targets reach float16's maximum over
    `TARGET_FACTOR`, as `Failure`s of the layers that produce them."""
    outputs = keras.tree.flatten(y_pred)
    targets = keras.tree.flatten(y) if y is not None else []
    if len(outputs) != len(targets):
        return []
    failures = []
    for output, target in zip(outputs, targets):
        if not (tf.is_tensor(output) and output.dtype == tf.float16):
            continue
        largest = float(tf.reduce_max(tf.abs(tf.cast(target, tf.float32))))
        if largest < rule.FLOAT16_MAX / TARGET_FACTOR:
            continue
        producer = _producer(calls, output)
        if producer is not None:
            failures.append(
                Failure(
                    nonfinite.layer_path(producer),
                    f"{promote.TARGETS} (targets up to {largest:.4g}; float16 "
                    f"holds at most {rule.FLOAT16_MAX:g})",
                )
            )
    return failures


def backward_failures(forward) -> list:
    """The `Failure`s of the backward pass of a `backward_search.Forward`:
    [] when its gradients are finite at a global scale of 1; else the
    layer whose float16 backward pass is not finite even at `rule.MIN_SCALE`,
    or the float16 model output whose gradient from the loss fits float16
    only at a scale below 1 (a float16 softmax under a cross-entropy on
    probabilities)."""
    at_one = forward.at(1.0)
    if at_one is None:
        return []
    floor = round(math.log2(rule.MIN_SCALE))
    at_floor = forward.at(2.0**floor)
    if at_floor is not None:
        if at_floor.layer is None:
            return []  # The loss itself: no promotion helps.
        reason = f"{promote.BACKWARD} ({at_floor.what}) at every loss scale"
        return [Failure(at_floor.layer, reason)]
    above = _lowest_failing(forward, floor, 0, at_one)
    if above.what != nonfinite.OUTPUT_GRADIENT or above.layer is None:
        return []
    # Below 1 the scale shrinks every gradient of the model to serve this
    # output: it is the layer that fails.
    reason = (
        f"{promote.BACKWARD} ({above.what}): its float16 output cannot "
        "carry the loss's gradient at any loss scale of 1 or more"
    )
    return [Failure(above.layer, reason)]


def _lowest_failing(forward, low: int, high: int, above) -> nonfinite.Finding:
    """Where the gradients of a `backward_search.Forward` turn non-finite
    at the smallest power of two that fails, between `2**low` (finite) and
    `2**high` (not: `above`). What the finite pass at `2**low` measured
    (`Forward.largest`) names the last scale at which the layers' inputs,
    outputs and float16 weight gradients fit: that exponent and the next
    are tried first, so that a failure in what is measured (a float16
    softmax output under a cross-entropy) costs two backward passes where
    a bisection from 2**-24 to 1 made five. A failure inside a layer, which
    nothing measured shows, leaves the guess wrong, and the bisection goes
    on from what it found."""
    largest = forward.largest(2.0**low)
    guesses = [] if largest is None else [math.floor(math.log2(largest))]
    guesses += [g + 1 for g in guesses]
    while high - low > 1:
        middle = guesses.pop(0) if guesses else (high + low) // 2
        if not low < middle < high:
            continue
        finding = forward.at(2.0**middle)
        if finding is None:
            low = middle
        else:
            high, above = middle, finding
    return above


def largest_finite_scale(forward, scale: float) -> Optional[float]:
    """The largest power of two, at most `scale` and at least `rule.MIN_SCALE`,
    at which the gradients of a `backward_search.Forward` are finite; None
    when there is none.

    A bisection between a scale that overflows and one that does not. A
    finite try measures the largest scale at which the layers' float16
    input and output gradients fit (`Forward.largest`): every larger
    scale overflows them, so the bisection's upper end comes down to it,
    and its first try is that scale: when nothing inside a layer
    overflows first, that is the answer. A model whose initial scale
    overflows costs three backward passes (the initial scale, 1 and that
    one) where a plain bisection made about eight."""
    bad = math.floor(math.log2(scale))
    if forward.at(2.0**bad) is None:
        return 2.0**bad
    good = min(0, bad - 1)
    if forward.at(2.0**good) is not None:
        bad, good = good, round(math.log2(rule.MIN_SCALE))
        if forward.at(2.0**good) is not None:
            return None
    guessed = False
    while True:
        largest = forward.largest(2.0**good)
        if largest is not None:
            bad = min(bad, math.floor(math.log2(largest)) + 1)
        if bad - good <= 1:
            return 2.0**good
        middle = (good + bad) // 2
        if largest is not None and not guessed:
            guessed, middle = True, bad - 1
        if forward.at(2.0**middle) is None:
            good = middle
        else:
            bad = middle


def _to_float32(structure):
    return keras.tree.map_structure(
        lambda t: tf.cast(t, tf.float32)
        if tf.is_tensor(t) and t.dtype in (tf.float16, tf.bfloat16)
        else t,
        structure,
    )


def _unique(failures) -> list:
    seen, result = set(), []
    for finding in failures:
        if finding.layer not in seen:
            seen.add(finding.layer)
            result.append(finding)
    return result
