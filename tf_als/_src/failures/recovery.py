"""When steps are skipped: promote the failing layers to float32, or stop.

`AdaptiveLossScaleOptimizer.check_skips` and `.preflight` hand over to the
optimizer's `Recovery`, which reads the skip counters (`training.skips`)
and acts, in this order:

1. **First check.** In a custom loop, the first `check_skips` with batches
   and the loss (on one of the first two steps) runs the preflight `fit`
   runs before its first step: the layers whose float16 arithmetic fails
   on a real batch are promoted and the global scale S is set where the
   batch's gradients are finite (`preflight`).
2. **Storm.** `max_consecutive_skips` steps skipped in a row: promote
   (`preflight` on up to 8 batches), or raise `storm.NonFiniteStormError`
   naming the layer whose gradient was first non-finite.
3. **Frequent skips.** As many skipped steps within twice that many, not
   in a row: promote, or warn once.
4. **A loss that is not finite.** The second skipped step whose loss was
   not finite (the forward pass overflowed, which no loss scale helps),
   in a row or not: promote then, quietly when no layer fails, so that a
   layer that starts to overflow mid-run costs two skipped steps, as the
   expert's fix costs a few, not the dozen it takes S to halve below 1.
5. **Below one.** A skip took S below 1 (usually a float16 model output
   that cannot carry the loss's gradient): promote quietly when a layer
   fails, looking again only once S has fallen another 2**4.

After a promotion (or the first batch's preflight) the run restarts from
the same step: S set anew, the skip counts forgotten (`restart`).

`fit` checks after every batch, so the common case, no step skipped in the
current window, costs one read of one counter (`skips.skipped_lately`):
each read of a variable from Python costs about 0.1 ms on this project's
CPU, and the five a check read before took a third of a 2 ms step of the
tiny GPT-2 (docs/performance.md).
"""

import itertools
import warnings

import keras

from tf_als._src.failures import backward_search
from tf_als._src.failures import preflight as preflight_module
from tf_als._src.failures import promote as promote_module
from tf_als._src.failures import silent
from tf_als._src.failures import storm
from tf_als._src.scaling import rule
from tf_als._src.training import handoff
from tf_als._src.training import skips

# Batches a storm re-runs, at most.
STORM_BATCHES = 8


class Recovery:
    """What one optimizer's run has checked so far (plain Python state: it
    only steers eager checks between steps).

    Attributes:
        loop_checks: a loop called `check_skips` with batches; an eager
            `apply` then leaves the check (and the promotion) to the loop.
        preflown: the first batch was checked (`preflight`).
        looked_below: the global scale at which a scale below 1 was last
            looked into (inf: not yet).
        seen_skips: the skipped steps of the current window at the last
            check.
        loss_skips, loss_skips_to_look: skipped steps with a loss that was
            not finite since the last look, and how many make the next.
        gave_up_on_window: frequent skips were warned of, once.
        warned_plain: gradients of no instrumented model were warned of.
        warned_unchecked: a first step without the check was warned of.
    """

    def __init__(self):
        self.loop_checks = False
        self.preflown = False
        self.looked_below = float("inf")
        self.seen_skips = 0
        self.loss_skips = 0
        self.loss_skips_to_look = 2
        self.gave_up_on_window = False
        self.warned_plain = False
        self.warned_unchecked = False

    def check(self, optimizer, attempted=None, batches=None, loss=None) -> list:
        """`optimizer.check_skips`: the promotions made (see the module)."""
        if batches is not None:
            self.loop_checks = True
        if not optimizer.built:
            return []
        for model in optimizer.applied_models():
            silent.warn_silent_failures(model, stacklevel=4)
        if optimizer.max_consecutive_skips is None:
            return []
        first = self._first_check(optimizer, batches, loss)
        if first:
            return first
        if not skips.skipped_lately(optimizer):
            self.seen_skips = 0
            return []  # No streak, no frequent skips, no skip below 1.
        streak = skips.streak(optimizer)
        if skips.stops(optimizer):
            made, why = self._promote(optimizer, batches, loss)
            if made:
                return list(made)
            message = storm.describe(optimizer, streak, attempted)
            if why is not None:
                message += f" promote_on_storm: {why}."
            raise storm.NonFiniteStormError(message)
        if skips.frequent(optimizer) and not self.gave_up_on_window:
            return self._promote_on_frequent_skips(optimizer, batches, loss)
        made = self._promote_on_non_finite_loss(optimizer, batches, loss)
        return made or self._promote_below_one(optimizer, streak, batches, loss)

    def preflight(self, optimizer, model, batches, loss=None, limit=1, first=True) -> tuple:
        """`optimizer.preflight` (built): (promotions, why none or None)."""
        self.preflown = True
        step = int(keras.ops.convert_to_numpy(optimizer.iterations))
        loss_fn, triples = _loss_and_batches(loss, batches)
        outcome = preflight_module.run(
            model,
            itertools.islice(triples(), limit),
            loss_fn,
            optimizer.initial_scale,
            step,
            choose=first,
        )
        for promotion in outcome.promotions:
            warnings.warn(
                f"tf_als promoted layer {promotion.layer!r} to float32 at step "
                f"{promotion.step}: {promotion.reason}. Training goes on "
                "from the same step (tf_als.promoted(model) lists "
                "promotions).",
                stacklevel=5,
            )
        if outcome.promotions:
            model.forget_traces()  # The promoted layers trace in float32.
        if outcome.promotions or first:
            self.restart(optimizer, model, outcome.scale)
            _calibrate_gains(model, outcome.gains)
        return outcome.promotions, outcome.stopped

    def restart(self, optimizer, model, scale) -> None:
        """Sets the global scale to `scale` (None: where it was before the
        skips) and forgets the skip counts; the next backward pass of
        `model` reads the new back-off."""
        if scale is None:
            current = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
            scale = min(optimizer.initial_scale, current * 2.0 ** skips.streak(optimizer))
        optimizer.dynamic_scale.assign(max(scale, rule.MIN_SCALE))
        optimizer.step_counter.assign(0)
        skips.reset(optimizer)
        self.seen_skips = self.loss_skips = 0
        self.looked_below = float("inf")
        handoff.schedule(optimizer, model)

    def _first_check(self, optimizer, batches, loss) -> list:
        """In a custom loop, the first check with batches and the loss, on
        one of the first two steps, runs the preflight `fit` runs before its
        first step."""
        if self.preflown or batches is None or loss is None:
            return []
        self.preflown = True
        models = optimizer.applied_models()
        step = int(keras.ops.convert_to_numpy(optimizer.iterations))
        if not optimizer.promote_on_storm or len(models) != 1 or step > 1:
            return []
        made, _ = self.preflight(optimizer, models[0], batches, loss, first=step == 0)
        return list(made)

    def _promote_on_frequent_skips(self, optimizer, batches, loss) -> list:
        """Half the steps of the window skipped, not in a row (a layer that
        overflows on some batches): promote, or say once why not."""
        window = skips.window(optimizer)[0]
        made, why = self._promote(optimizer, batches, loss)
        if made:
            return list(made)
        self.gave_up_on_window = True
        steps = skips.window(optimizer)[1]
        warnings.warn(
            f"{window} of the last {steps} training steps were skipped "
            "because their gradients were not finite; the global loss scale "
            "keeps halving and most gradients may underflow. "
            + (f"promote_on_storm: {why}. " if why else "")
            + "Run tf_als.diagnose(model, x, y) on a batch to see where.",
            stacklevel=4,
        )
        return []

    def _promote_on_non_finite_loss(self, optimizer, batches, loss) -> list:
        """Skipped steps whose loss itself was not finite: the forward
        pass overflowed (a hand-written `exp` past 11.09), which halving S
        cannot help, in a row or not (a layer that overflows on some
        batches only). At the second such skip, looks, the latest batches
        first, and promotes; says nothing when no layer fails (batches of
        bad data: the storm, if one follows, says so), and then waits for
        twice as many before it looks again. A single skip is left alone:
        a one-off overflow costs one step, as with Keras's."""
        skipped = skips.window(optimizer)[0]
        new = skipped > self.seen_skips or (skipped < self.seen_skips and skipped > 0)
        self.seen_skips = skipped
        if not new or batches is None:
            return []
        if int(keras.ops.convert_to_numpy(optimizer.loss_finite)) != 0:
            return []
        self.loss_skips += 1
        if self.loss_skips < self.loss_skips_to_look:
            return []
        self.loss_skips = 0
        made, _ = self._promote(optimizer, batches, loss, explain=False)
        if not made:
            self.loss_skips_to_look *= 2
        return list(made)

    def _promote_below_one(self, optimizer, streak, batches, loss) -> list:
        """A skip took the global scale below 1: every gradient of the model
        is now shrunk to serve one, usually a float16 model output that
        cannot carry the loss's gradient (a float16 softmax under a
        cross-entropy). Looks for such a layer, the latest batches first,
        and promotes it; says nothing when there is none (a model whose
        gradients are large everywhere). Looks again only once the scale
        has fallen another 2**4."""
        if streak == 0 or batches is None or loss is None:
            return []
        scale = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
        if scale >= min(1.0, self.looked_below / 2.0**4):
            return []
        self.looked_below = scale
        made, _ = self._promote(optimizer, batches, loss)
        return list(made)

    def _promote(self, optimizer, batches, loss, explain=True) -> tuple:
        """(promotions made, why none or not enough) for the skips now:
        `preflight` on up to `STORM_BATCHES` of `batches`, and the global
        scale re-calibrated on them. `explain`: when nothing was found,
        run the batches in float32 to say whether the data are to blame."""
        models = optimizer.applied_models()
        if not optimizer.promote_on_storm or not models:
            return (), None
        if len(models) > 1:
            names = ", ".join(repr(m.name) for m in models)
            return (), (
                f"this optimizer trains several instrumented models ({names}), "
                "and re-running batches needs one model from inputs to loss"
            )
        if batches is None:
            return (), "no training batches were given to re-run"
        loss_finite = int(keras.ops.convert_to_numpy(optimizer.first_non_finite)[2])
        if loss is None and loss_finite != 0:
            return (), (
                "the loss was finite at the first skipped step, so the "
                "backward pass failed, and re-running it needs the loss "
                "(pass `loss=` and batches of `(x, y)` to check_skips, or "
                "`step_loss=` and the step's batches)"
            )
        made, why = self.preflight(
            optimizer, models[0], batches, loss, limit=STORM_BATCHES, first=False
        )
        if not made and why is None and explain:
            why = _nothing_found(models[0], batches, loss)
        if why is not None and made:
            promoted = ", ".join(repr(p.layer) for p in promote_module.promoted(models[0]))
            return (), f"{why} (promoted so far: {promoted})"
        return made, why


def _nothing_found(model, batches, loss) -> str:
    """Why a storm's re-run promoted nothing, decided by running the same
    batches in float32: the data are blamed only when float32 fails on
    them too."""
    loss_fn, triples = _loss_and_batches(loss, batches)
    batches = itertools.islice(triples(), STORM_BATCHES)
    if preflight_module.clean_in_float32(model.uninstrumented(), batches, loss_fn):
        return (
            "the same batches run in float32 with a finite loss and finite "
            "gradients, so the data are fine and float16 fails, but an eager "
            "re-run found no layer whose float16 arithmetic fails on them "
            "(the skipped steps' own batches or dropout draws may differ, "
            "or the failure is outside the model's layers: in the loss or "
            "the training step), so no layer was promoted to float32"
        )
    return (
        "the loss or the gradients of these batches are not finite in "
        "float32 either, so no float16 setting can help: check the inputs "
        "and labels for NaN or inf (np.isfinite(x).all()), whether the "
        "loss overflows, and layers that fail at any precision"
    )


def user_loss(loss, step_loss):
    """The loss the checks re-run (`Recovery`): `loss`, or `step_loss` as a
    `backward_search.StepLoss`; raises when both are given or either is
    not callable."""
    if loss is not None and step_loss is not None:
        raise ValueError(
            "Pass `loss` (a loss of the model's outputs, `loss(y_true, "
            "y_pred)`) or `step_loss` (the step's loss from a batch, "
            "`step_loss(batch)`), not both."
        )
    for name, value in (("loss", loss), ("step_loss", step_loss)):
        if value is not None and not callable(value):
            raise TypeError(
                f"`{name}` must be callable; received {value!r} of type "
                f"{type(value).__name__}."
            )
    return backward_search.StepLoss(step_loss) if step_loss is not None else loss


def _loss_and_batches(loss, batches) -> tuple:
    """The `loss_fn` the checks take (`preflight.check`) and a callable
    returning the batches as they take them, from the loss a user passed
    (`loss(y, y_pred)`, a `backward_search.StepLoss`, or None) and
    `batches`."""
    if isinstance(loss, backward_search.StepLoss):
        return loss, batches
    if loss is None:
        return None, _inputs_only(batches)
    return preflight_module.batch_mean_loss(loss), _triples_of(batches)


def _triples_of(batches):
    """`batches` of `(x, y)` or `(x, y, sample_weight)` as triples."""
    return lambda: (
        keras.utils.unpack_x_y_sample_weight(tuple(b)) for b in batches()
    )


def _inputs_only(batches):
    """Input `batches` as `(x, None, None)` triples."""
    return lambda: ((x, None, None) for x in batches())


def _calibrate_gains(model, gains) -> None:
    """Writes the gains the check measured (`{id(layer): gain}`) into the
    rows of the scaling points of those layers, so that the first step's
    scales keep the weight gradients within float16 already; the other
    rows keep theirs."""
    rows = {
        point.index: gains[id(point.layer)]
        for point in model.point_records
        if id(point.layer) in gains
    }
    if not rows:
        return
    current = keras.ops.convert_to_numpy(model.scaling_state.gains).copy()
    for index, gain in rows.items():
        current[index] = gain
    model.scaling_state.gains.assign(current)
