"""Where a float16 forward pass stops being finite: an eager re-run that
names the first layer whose output is not finite while its inputs are.

Used when something already failed (`tf_als.diagnose`, and the storm error
when training stops), so its cost, one eager forward pass per batch tried,
is paid only then.
"""

import contextlib
from typing import Optional

import keras
import tensorflow as tf

from tf_als._src.model import _keras


def first_non_finite_output(model, x, training=True) -> Optional[str]:
    """Runs `model` on `x` eagerly and returns the path of the first layer,
    innermost first, whose float output is not finite while its float
    inputs are; None when every layer output is finite.

    Example:

    ```python
    tf_als.forward.first_non_finite_output(model, x_batch)   # "block_3/mlp"
    ```
    """
    found = []

    def check(layer, inputs, outputs):
        if not found and _all_finite(inputs) and not _all_finite(outputs):
            found.append(getattr(layer, "path", None) or layer.name)

    with preserved(model.non_trainable_variables), _keras.layer_calls(check):
        model(x, training=training)
    return found[0] if found else None


@contextlib.contextmanager
def preserved(variables):
    """Within this block the `variables` may change; on leaving, they hold
    their old values again. An eager diagnostic re-run of a training batch
    keeps BatchNormalization's moving statistics and the dropout seeds as
    training left them."""
    saved = [(v, keras.ops.copy(v.value)) for v in variables]
    try:
        yield
    finally:
        for variable, value in saved:
            variable.assign(value)


def search(model, batches, limit: int = 8, training=True) -> Optional[str]:
    """`first_non_finite_output` on up to `limit` input batches of
    `batches` (an iterable), stopping at the first that names a layer."""
    for count, x in enumerate(batches):
        if count >= limit:
            break
        culprit = first_non_finite_output(model, x, training)
        if culprit is not None:
            return culprit
    return None


def _all_finite(structure):
    for value in keras.tree.flatten(structure):
        if tf.is_tensor(value) and value.dtype.is_floating:
            if not bool(tf.reduce_all(tf.math.is_finite(value))):
                return False
    return True
