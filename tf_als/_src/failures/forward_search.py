"""Where a float16 forward pass stops being finite: an eager re-run that
names the first layer whose output is not finite while its inputs are.

Used when something already failed (`tf_als.diagnose`, and the storm error
when training stops), so its cost, one eager forward pass per batch tried,
is paid only then.
"""

from typing import Iterable, Optional

import keras

from tf_als._src.model import _keras
from tf_als._src.failures import nonfinite
from tf_als._src.failures.nonfinite import Finding


def first_non_finite(model: keras.Model, x, training: bool = True) -> Optional[Finding]:
    """Runs `model` on `x` eagerly and returns where its output turned
    non-finite: the first layer, innermost first, whose float output is not
    finite while its float inputs are (`nonfinite.FORWARD_OUTPUT`); None
    when every layer output is finite.

    Example:

    ```python
    forward_search.first_non_finite(model, x_batch)
    # Finding(layer='block_3/mlp', what='forward output', ...)
    ```
    """
    found = []

    def check(layer, inputs, outputs):
        if found or not nonfinite.all_finite(inputs) or nonfinite.all_finite(outputs):
            return
        found.append(Finding(nonfinite.layer_path(layer), nonfinite.FORWARD_OUTPUT))

    with nonfinite.preserved(model.variables):
        with _keras.layer_calls(check):
            model(x, training=training)
    return found[0] if found else None


def first_non_finite_output(
    model: keras.Model, x, training: bool = True
) -> Optional[str]:
    """The path of the layer `first_non_finite` names; None when every
    layer output is finite.

    Example:

    ```python
    forward_search.first_non_finite_output(model, x_batch)   # "block_3/mlp"
    ```
    """
    finding = first_non_finite(model, x, training)
    return None if finding is None else finding.layer


def search(
    model: keras.Model, batches: Iterable, limit: int = 8, training: bool = True
) -> Optional[Finding]:
    """`first_non_finite` on up to `limit` input batches of `batches` (an
    iterable), stopping at the first that names a layer
    (`nonfinite.search`)."""
    return nonfinite.search(
        lambda x: first_non_finite(model, x, training), batches, limit
    )
