"""The private Keras names tf_als relies on (Keras 3.15), in one place.

Each helper says what it reads and the public alternative, if any, so that
a Keras upgrade is checked here and nowhere else.
"""


def sublayers(layer, recursive: bool) -> list:
    """The layers tracked inside `layer` (not `layer` itself), in attribute
    order, each once. Keras 3.15 `Layer._flatten_layers`; there is no
    public equivalent for an arbitrary layer (`Model.layers` covers models
    only, and not recursively)."""
    return layer._flatten_layers(include_self=False, recursive=recursive)
