"""The private Keras names tf_als relies on (Keras 3.15), in one place.

Each helper says what it reads and the public alternative, if any, so that
a Keras upgrade is checked here and nowhere else.
"""

import contextlib

import keras


def sublayers(layer, recursive: bool) -> list:
    """The layers tracked inside `layer` (not `layer` itself), in attribute
    order, each once. Keras 3.15 `Layer._flatten_layers`; there is no
    public equivalent for an arbitrary layer (`Model.layers` covers models
    only, and not recursively)."""
    return layer._flatten_layers(include_self=False, recursive=recursive)


def serving_specs(model) -> list:
    """The `tf.TensorSpec`s (batch dimension None) of the positional
    arguments `model.export` serves, as Keras derives them: from the inputs
    of a Functional or Sequential model, from the shapes of the first call
    of a subclassed one. Keras 3.15 `keras.src.export.export_utils`
    (`get_input_signature`, `make_tf_tensor_spec`); the public
    `model.export` uses them but does not expose them."""
    from keras.src import tree
    from keras.src.export import export_utils

    return [
        tree.map_structure(
            lambda x: export_utils.make_tf_tensor_spec(x, dynamic_batch=True), arg
        )
        for arg in export_utils.get_input_signature(model)
    ]


def compile_arguments(model):
    """The arguments `model.compile` was last called with (the objects
    themselves, not their configs), or None if `model` is not compiled.
    Keras 3.15 `Trainer._compile_config.config`; the public
    `get_compile_config()` returns serialized copies."""
    if not getattr(model, "compiled", False):
        return None
    config = getattr(model, "_compile_config", None)
    return None if config is None else dict(config.config)


def all_layers(model) -> list:
    """`model` and every layer tracked inside it, each once."""
    return [model] + sublayers(model, recursive=True)


@contextlib.contextmanager
def dtype_policy(layers, name):
    """Within this block, every layer of `layers` (input layers excepted)
    computes under the dtype policy `name` (no change for None); the
    policies are restored on exit. Keras 3.15 keeps a layer's policy in
    `Layer._dtype_policy`; the public setter would write into a shared
    `DTypePolicyMap` instead of replacing it, and restoring through it
    would nest the map in itself."""
    if name is None:
        yield
        return
    policy = keras.dtype_policies.get(name)
    saved = [
        (layer, layer._dtype_policy)
        for layer in layers
        if isinstance(layer, keras.layers.Layer)
        and not isinstance(layer, keras.layers.InputLayer)
    ]
    # A nested model built under mixed_float16 may record float16 inputs
    # (a Sequential's inputs take its compute dtype), which Keras casts to
    # on entry: under a float32 policy they are float32 too.
    inputs = []
    if policy.compute_dtype == "float32":
        inputs = [
            x for layer in layers for x in _graph_inputs(layer) if x.dtype == "float16"
        ]
    try:
        for layer, _ in saved:
            layer._dtype_policy = policy
        for x in inputs:
            x._dtype = "float32"  # Keras 3.15 KerasTensor._dtype (immutable API)
        yield
    finally:
        for layer, original in saved:
            layer._dtype_policy = original
        for x in inputs:
            x._dtype = "float16"


def _graph_inputs(layer) -> list:
    """The input KerasTensors of a Functional or built Sequential model (the
    ones Keras converts call arguments to); [] for any other layer. Keras
    3.15 `Sequential._functional`."""
    if isinstance(layer, keras.Sequential):
        layer = layer._functional
    if isinstance(layer, keras.Model) and hasattr(layer, "_inputs_struct"):
        return list(layer.inputs)
    return []


@contextlib.contextmanager
def layer_calls(callback):
    """Within this block, `callback(layer, inputs, outputs)` runs after
    every `Layer.__call__` (innermost calls complete first). For eager
    diagnostics only: it patches Keras's `Layer.__call__` for the block,
    in this thread's view and every other's."""
    original = keras.layers.Layer.__call__

    def calling(layer, *args, **kwargs):
        outputs = original(layer, *args, **kwargs)
        callback(layer, (args, kwargs), outputs)
        return outputs

    keras.layers.Layer.__call__ = calling
    try:
        yield
    finally:
        keras.layers.Layer.__call__ = original
