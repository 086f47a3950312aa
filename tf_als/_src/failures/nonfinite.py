"""Where values turned non-finite: the one result type of the searches that
say so, and the pieces they share.

Three searches name the place: `forward` (the first layer whose float16
output is not finite while its inputs are), `backward_search` (the first
layer, walking from the loss, whose backward pass turns a finite gradient
into a non-finite one) and `locate` (the same walk over an instrumented
model's plan, from the values a compiled step recorded). Each answers with
a `Finding`; `search` runs one of them over batches.
"""

import contextlib
import dataclasses
import itertools
from typing import Any, Callable, Iterable, Optional

import keras
import tensorflow as tf

# What turned non-finite (`Finding.what`).
FORWARD_OUTPUT = "forward output"
WEIGHTS = "weight gradients"
INPUTS = "input gradient"
OUTPUT_GRADIENT = "gradient from the loss at its output"
LOSS_VALUE = "the loss itself"
OUTSIDE = "a gradient outside any layer"


@dataclasses.dataclass(frozen=True)
class Finding:
    """Where the values of one batch turned non-finite.

    Attributes:
        layer: the layer's path (`layer_path`; the plan walk of `locate`
            gives the called layer's name, as the plan's calls name it), or
            None when no layer is to blame (`LOSS_VALUE`, `OUTSIDE`).
        what: which values are not finite: `FORWARD_OUTPUT` (the layer's
            output, its inputs being finite), `WEIGHTS` or `INPUTS` (the
            gradients its backward pass gives its weights or hands to its
            inputs, the gradient reaching it being finite),
            `OUTPUT_GRADIENT` (the loss's gradient does not fit the layer's
            float16 output, a model output), `LOSS_VALUE` or `OUTSIDE`.
        point: the scaling point's name, as `tf_als.scales` names it (the
            plan walk only; else None).
        receivers: the names of the scaling points whose input gradient
            reaches that point (the plan walk only; empty: the loss's
            gradient reaches it directly).

    Example:

    ```python
    Finding("block_3/mlp", FORWARD_OUTPUT)
    Finding("dense_1", WEIGHTS, point="dense_1", receivers=("head",))
    ```
    """

    layer: Optional[str]
    what: str
    point: Optional[str] = None
    receivers: tuple = ()


def search(
    find: Callable[[Any], Optional[Finding]], batches: Iterable, limit: int = 8
) -> Optional[Finding]:
    """`find(batch)` on up to `limit` batches of `batches` (an iterable),
    stopping at the first that returns a `Finding`; None when none does.
    Batches past the limit are not drawn.

    Example:

    ```python
    search(lambda x: forward_search.first_non_finite(model, x), batches, limit=4)
    # Finding(layer='logits', what='forward output', ...)
    ```
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(
            f"`limit` must be an int >= 0 (how many batches to try); "
            f"received {limit!r}."
        )
    for batch in itertools.islice(batches, limit):
        finding = find(batch)
        if finding is not None:
            return finding
    return None


def layer_path(layer) -> str:
    """`layer`'s path (`Layer.path`, e.g. "block_3/mlp"), or its name where
    it has none."""
    return getattr(layer, "path", None) or layer.name


def floats(structure) -> list:
    """The floating-point tensors in the nested `structure`, in order."""
    return [
        t
        for t in keras.tree.flatten(structure)
        if tf.is_tensor(t) and t.dtype.is_floating
    ]


def all_finite(structure) -> bool:
    """Whether every floating-point tensor in the nested `structure` is
    finite (an `IndexedSlices` gradient by its values; None and other
    values count as finite).

    Example:

    ```python
    all_finite([tf.constant([1.0]), None])        # True
    all_finite({"a": tf.constant([float("inf")])})  # False
    ```
    """
    values = [
        v.values if isinstance(v, tf.IndexedSlices) else v
        for v in keras.tree.flatten(structure)
    ]
    return all(bool(tf.reduce_all(tf.math.is_finite(t))) for t in floats(values))


@contextlib.contextmanager
def preserved(variables):
    """Within this block the `variables` may change; on leaving, they hold
    their old values again. An eager diagnostic re-run of a training batch,
    given a model's `variables`, leaves every one as training left them:
    BatchNormalization's moving statistics, the dropout seeds, and the
    weights a layer assigns in its own `call` (`SpectralNormalization`
    normalises its kernel and advances its power iteration's `vector_u`).
    Saving costs no copy: a read of a variable is a snapshot that an
    assignment does not overwrite.

    The block receives a function that saves more variables the same way,
    on first sight (the layers a custom step's loss turns out to call)."""
    saved = {}

    def keep(more):
        for variable in more:
            if id(variable) not in saved:
                saved[id(variable)] = (variable, keras.ops.copy(variable.value))

    keep(variables)
    try:
        yield keep
    finally:
        for variable, value in saved.values():
            variable.assign(value)
