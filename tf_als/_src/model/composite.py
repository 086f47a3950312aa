"""Opening composite layers: the weight-owning layers inside a layer's call.

A Functional plan sees a custom layer, a `MultiHeadAttention`, a KerasHub
transformer block or a subclassed model as one call. This module says which
such layers are opened and which weights a point of them unscales; the
*inner* scaling points an opened layer contains (every sublayer that owns
weights directly, at any depth, named by its path of layer names) are
found by `points.inner`, pure Python, once, by `instrument()`. At run time
(`hooks`) each call of such a sublayer made while its enclosing point
runs becomes a scaling point of its own; nothing is traced symbolically, so
any Python the composite runs (dynamic shapes, caches, masks, raw `tf.*`
ops, branches on `training`) runs exactly as it would without tf_als.

Some layers are not opened and stay one point, with a reason
(`CLOSED_TYPES`): recurrent layers call their cell inside a loop, where a
per-call custom gradient cannot be placed.
"""

from typing import Optional

import keras

from tf_als._src.model import _keras

# Layer types whose sublayers are never opened, and why.
CLOSED_TYPES = (
    (
        keras.layers.RNN,
        "a recurrent layer calls its cell inside a loop (tf.while_loop), "
        "where a per-call scaling point cannot be placed",
    ),
    (
        keras.layers.TimeDistributed,
        "TimeDistributed may call its layer inside a loop or vectorized map, "
        "where a per-call scaling point cannot be placed",
    ),
)


def own_weights(layer) -> list:
    """The weights `layer` owns directly (not through a sublayer)."""
    inner = set()
    for sublayer in _keras.sublayers(layer, recursive=True):
        inner.update(id(w) for w in sublayer.weights)
    return [w for w in layer.weights if id(w) not in inner]


def point_weights(layer) -> list:
    """The trainable weights whose gradients a scaling point of `layer`
    unscales: its own, when it is opened (its weighted sublayers are points
    of their own), else all of them."""
    weights = own_weights(layer) if opens(layer) else layer.weights
    trainable = {id(w) for w in layer.trainable_weights}
    return [w for w in weights if id(w) in trainable]


def closed_reason(layer) -> Optional[str]:
    """Why `layer`'s weighted sublayers cannot be opened, or None."""
    for closed_type, reason in CLOSED_TYPES:
        if isinstance(layer, closed_type):
            return reason
    return None


def has_weighted_sublayers(layer) -> bool:
    return any(
        sublayer.weights for sublayer in _keras.sublayers(layer, recursive=False)
    )


def opens(layer) -> bool:
    """Whether tf_als opens `layer`: a layer with weighted sublayers that
    is not of a closed type."""
    return (
        isinstance(layer, keras.layers.Layer)
        and has_weighted_sublayers(layer)
        and closed_reason(layer) is None
    )
