"""Where a float16 forward pass leaves float32's: the first layer whose
float16 output is not finite (`message`, when the float16 loss is not), or
departs from float32's while its inputs do not (`find`, when the float16
gradients are mostly zero at every scale: a sum that passes 65504 zeroes
every gradient with no inf in sight). One eager forward pass in each
precision, from the same random state, the layer calls matched in order.
"""

import math
from typing import Any, NamedTuple, Optional

import keras
import numpy as np
import tensorflow as tf

from tf_als._src.failures import forward_search
from tf_als._src.failures import nonfinite
from tf_als._src.failures import promote
from tf_als._src.model import _keras
from tf_als._src.scaling import rule

# A float16 output at least this large (65504 / 16 = 4094, within a factor
# 2**4 of float16's maximum, the threshold of tf_als's forward headroom
# telemetry and warnings) counts as overflowing: growth by that factor, or
# a float16 sum over that many of its elements, reaches inf.
NEAR_MAX = rule.NEAR_MAX_THRESHOLD


# A float16 loss or layer output this far from float32's (relative norm)
# is not rounding: float16 rounds each operation to 2**-11, and a forward
# pass compounds that to ~1e-3 (0.1% on GPT-2 tiny); 2**-4 is 6%.
DEPARTURE = 2.0**-4


LOSS_ONLY = "loss"  # `Diagnosis.forward_overflow` when the loss itself overflows.


def message(model, batch):
    """What to say when the float16 loss is not finite but the float32 one
    is: the first layer whose float16 output is not finite."""
    batch.rewind()
    culprit = forward_search.first_non_finite_output(model, batch.x, batch.training)
    if culprit is None:
        return (
            "The loss is not finite in float16 (it is in float32), though "
            "every layer output is: the loss itself overflows float16; "
            "compute it in float32 (a float32 last layer, as Keras's mixed "
            "precision guide recommends)."
        )
    return (
        f"The float16 forward pass is not finite (float32 is): layer "
        f"{culprit!r} is the first whose output is not finite while its "
        f"inputs are. {promote.advice(model, culprit)} Else check its "
        "weights and inputs for very large values."
    )


def find(model, batch, loss16, loss32) -> Optional[str]:
    """`Diagnosis.forward_overflow`: the layer where the float16 forward pass
    departs from float32's (`_first_departing_layer`), else `LOSS_ONLY` when
    only the loss does (by more than `DEPARTURE`, relative), else None."""
    culprit = _first_departing_layer(model, batch)
    if culprit is not None:
        return culprit
    if abs(loss16 - loss32) > DEPARTURE * max(abs(loss16), abs(loss32)):
        return LOSS_ONLY
    return None


class _Call(NamedTuple):
    """One layer call of an eager forward pass: its float inputs and
    outputs (as float32 arrays) and the largest magnitude of its float16
    outputs (inf if one is not finite; 0 without float16 outputs)."""

    layer: Any
    inputs: list
    outputs: list
    amax16: float


def _first_departing_layer(model, batch) -> Optional[str]:
    """The path of the first layer call (innermost first) whose float16
    output is inf or off from float32's by more than `DEPARTURE` (relative)
    while its inputs are not: where the forward pass leaves float32's, a
    sum or square inside the layer included. Failing that, of the first
    whose float16 output is inf or at least `NEAR_MAX` while its float32
    output is finite (an operation after it, outside any layer, overflows).
    None if there is neither. One eager forward pass in each precision,
    from the same random state, the calls matched in order; the model's
    own call is left out (naming the whole model would not help)."""
    half = _trace(model, batch)
    with _keras.dtype_policy(_keras.all_layers(model), "float32"):
        full = _trace(model, batch)
    pairs = []
    for h, f in zip(half, full):
        if h.layer is not f.layer:
            break  # The calls diverged (a layer that branches on its dtype).
        if h.layer is not model:
            pairs.append((h, f))
    for h, f in pairs:
        inputs_agree = _departure(h.inputs, f.inputs) <= DEPARTURE
        if inputs_agree and _departure(h.outputs, f.outputs) > DEPARTURE:
            return nonfinite.layer_path(h.layer)
    for h, f in pairs:
        if h.amax16 >= NEAR_MAX and all(np.all(np.isfinite(o)) for o in f.outputs):
            return nonfinite.layer_path(h.layer)
    return None


def _trace(model, batch) -> list:
    """The `_Call`s of one eager forward pass, in the order they complete."""
    calls = []

    def record(layer, inputs, outputs):
        float16 = [t for t in _float_tensors(outputs) if t.dtype == tf.float16]
        calls.append(
            _Call(
                layer=layer,
                inputs=[_as_array(t) for t in _float_tensors(inputs)],
                outputs=[_as_array(t) for t in _float_tensors(outputs)],
                amax16=_amax(float16),
            )
        )

    batch.rewind()
    with _keras.layer_calls(record):
        model(batch.x, training=batch.training)
    return calls


def _float_tensors(structure) -> list:
    return [
        t for t in keras.tree.flatten(structure)
        if tf.is_tensor(t) and t.dtype.is_floating
    ]


def _as_array(tensor) -> np.ndarray:
    return np.asarray(tf.cast(tensor, tf.float32))


def _amax(tensors) -> float:
    """The largest magnitude over `tensors`, inf if an element is not
    finite, 0.0 if there are none.

    >>> _amax([tf.constant([1.0, -3.0], tf.float16), tf.constant([2.0])])
    3.0
    >>> _amax([tf.constant([1.0, float("nan")], tf.float16)])
    inf
    """
    largest = 0.0
    for array in map(_as_array, tensors):
        if not np.all(np.isfinite(array)):
            return math.inf
        largest = max(largest, float(np.max(np.abs(array), initial=0.0)))
    return largest


def _departure(values, reference) -> float:
    """|values - reference| / |reference| over the arrays pooled, elements
    equal in both (inf included, as a -inf attention mask is) counting 0 and
    the norm taken over float32's finite elements; inf if any other element
    is not finite or the shapes differ.

    >>> _departure([np.array([1.0, -np.inf])], [np.array([1.0, -np.inf])])
    0.0
    >>> _departure([np.array([0.0, np.inf])], [np.array([3.0, 4.0])])
    inf
    >>> _departure([np.zeros(2)], [np.array([3.0, 4.0])])
    1.0
    """
    if [v.shape for v in values] != [r.shape for r in reference]:
        return math.inf
    if not values:
        return 0.0
    values = np.concatenate([np.ravel(v) for v in values]).astype(np.float64)
    reference = np.concatenate([np.ravel(r) for r in reference]).astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf, where they are equal
        difference = np.where(values == reference, 0.0, values - reference)
    if not np.all(np.isfinite(difference)):
        return math.inf
    norm = np.linalg.norm(np.where(np.isfinite(reference), reference, 0.0))
    distance = np.linalg.norm(difference)
    return float(distance / norm) if norm else (math.inf if distance else 0.0)
