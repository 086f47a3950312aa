"""The hooks an instrumented model puts on the layers inside its opened
points (`hooks`): each install has an owner and a way back, and a layer
comes back exactly as it was when the last instrumented model that hooked
it is garbage collected."""

import gc

import keras
import numpy as np

import tf_als
from tf_als._src.model import _keras, hooks
from tests import architectures


def _hooked_layers(model):
    return [
        layer for layer in _keras.sublayers(model, recursive=True)
        if hooks.installed(layer)
    ]


def test_uninstall_gives_the_layer_its_own_call_back():
    layer = keras.layers.Dense(3)
    layer.build((None, 2))
    x = np.ones((1, 2), "float32")
    before = np.asarray(layer(x))
    first, second = object(), object()
    assert hooks.install(layer, first) and hooks.install(layer, second)
    assert "call" in vars(layer)
    np.testing.assert_array_equal(np.asarray(layer(x)), before)  # no point runs
    assert hooks.uninstall(layer, first)
    assert hooks.installed(layer)  # `second` still needs it
    assert not hooks.uninstall(layer, first)  # once only
    assert hooks.uninstall(layer, second)
    assert "call" not in vars(layer) and not hooks.installed(layer)
    assert layer.call.__func__ is keras.layers.Dense.call


def test_a_layer_with_a_call_of_its_own_is_left_alone():
    layer = keras.layers.Dense(3)
    own = lambda *args, **kwargs: None  # noqa: E731
    object.__setattr__(layer, "call", own)
    assert not hooks.install(layer, object())
    assert vars(layer)["call"] is own
    assert not hooks.uninstall(layer, object())


def test_the_hooks_come_off_when_the_instrumented_models_are_collected(mixed):
    model = architectures.composite_layers()
    first = tf_als.instrument(model)
    hooked = _hooked_layers(model)
    assert len(hooked) == len([p for p in first.point_records if p.kind == "inner"]) > 0
    second = tf_als.instrument(model)  # the same layers, hooked twice
    del first
    gc.collect()
    assert _hooked_layers(model) == hooked  # still hooked for `second`
    del second
    gc.collect()
    assert _hooked_layers(model) == []
    assert all("call" not in vars(layer) for layer in hooked)
