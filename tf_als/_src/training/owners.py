"""Which instrumented models own the variables an optimizer applies.

An optimizer learns of a step only what `apply(grads, variables)` gives
it, and a step may train several instrumented models (a VAE's encoder and
decoder) with one optimizer, or several with several (a GAN). So the
optimizer finds the models whose scales it must update from the variables
it applies: every `tf_als.InstrumentedModel` registers here when it is
made, held weakly (a dropped model leaves), and `owning` matches by
variable identity. Nothing depends on which model or optimizer ran last.

Why module state, when tf_als keeps none elsewhere: the variables are the
only link between an optimizer and the models it trains. In a custom loop
or a GAN's `train_step` the model is never compiled with the optimizer and
no tf_als call names both, so no object the caller makes could hold the
registry and reach both sides; a registry held per optimizer would need
each model to know its optimizers beforehand, the "which optimizer drives
this model" state the design rules out. What is kept here is an index of
live objects, not training state: weak, so it never keeps a model alive,
read-only for the optimizer, and the same in every thread and replica.
"""

import itertools
import weakref

_models = weakref.WeakKeyDictionary()  # model -> the order it was made in
_order = itertools.count()


def register(model) -> None:
    """Adds an instrumented model to the models `owning` searches."""
    _models[model] = next(_order)


def owning(variables, scaled: bool = True) -> list:
    """The live instrumented models with a trainable variable among
    `variables`, in the order they were made: those with scaling points,
    or (`scaled=False`) those without, which compute nothing in float16."""
    wanted = {id(v) for v in variables}
    found = [
        (order, m) for m, order in list(_models.items())
        if bool(m.point_records) == scaled
        and any(id(v) in wanted for v in m.trainable_variables)
    ]
    return [m for _, m in sorted(found, key=lambda pair: pair[0])]
