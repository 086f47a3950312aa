"""`.keras` files written by tf_als 0.2, 0.3, 0.4 and 0.5 load (issue 37,
item 5).

Those versions saved the user's model nested in a wrapper; today's saves
the user's model itself (`tf_als._src.model.legacy`). Each file in
`tests/data/legacy` was written by its version (`tests/data/legacy/make.py`,
run from a checkout of the version) after two epochs of a small functional
model with one layer promoted to float32, beside what that version
measured: its predictions, promotions, scales, step count and global
scale. None of them is at its initial value (the scales are 1/8, 1 and
32, the global scale 8192 after two skipped steps), so a part that failed
to load shows.

Tolerances: the layers' and Adam's loaded variables are compared with the
file's bytes, the scales and counters with what the version recorded, and
the loaded model's
predictions bit for bit with those of a plain Keras model built here from
those bytes (the same operations on the same weights on the same CPU).
The predictions the writing version measured were computed on another
CPU (an AVX-512 Xeon); float32 kernels sum in another order elsewhere (an
AMD EPYC with AVX2 differs by 2.4e-7 on outputs of magnitude 0.2-1.7), so
they are compared to 1e-5 relative and 1e-6 absolute, about 4x the
difference seen; the bitwise comparisons above are what catch a variable
loaded wrongly.
"""

import io
import json
import os
import zipfile

import h5py
import keras
import numpy as np
import pytest

import tf_als

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "legacy")
VERSIONS = ("0.2", "0.3", "0.4", "0.5")


def _expected(version):
    return np.load(os.path.join(HERE, f"tf_als-{version}.npz"))


def _saved_arrays(path, group):
    """The arrays of `group` in the weights of the `.keras` file `path`, in
    the order they were saved."""
    with zipfile.ZipFile(path) as archive:
        weights = h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r")
        variables = weights[group]
        return [np.asarray(variables[key]) for key in sorted(variables, key=int)]


# The layers of make.py's model, and the names the old wrapper saved them
# under.
LAYERS_IN_FILE = {"d1": "dense", "bn": "batch_normalization", "d2": "dense_1"}


def _layer_arrays(path, layer):
    """The saved variables of make.py's layer `layer` in the file `path`."""
    return _saved_arrays(path, f"layers/functional/layers/{LAYERS_IN_FILE[layer]}/vars")


def _plain_model(path):
    """make.py's model, plain Keras (d1 in float32, as promoted), with the
    variables the file at `path` holds."""
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="sigmoid", name="d1", dtype="float32")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    model = keras.Model(inputs, keras.layers.Dense(3, dtype="float32", name="d2")(h))
    for layer in LAYERS_IN_FILE:
        model.get_layer(layer).set_weights(_layer_arrays(path, layer))
    return model


def _numpy(value):
    return keras.ops.convert_to_numpy(value)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_file_of_an_older_version_loads_with_all_its_state(mixed, version):
    path = os.path.join(HERE, f"tf_als-{version}.keras")
    expected = _expected(version)
    model = keras.models.load_model(path)

    assert isinstance(model, tf_als.InstrumentedModel)
    assert isinstance(model, keras.Model) and type(model).__name__ == "Functional"
    assert [layer.name for layer in model.layers] == ["input_layer", "d1", "bn", "d2"]
    assert [p.layer for p in tf_als.promoted(model)] == list(expected["promoted"])
    assert model.get_layer("d1").dtype_policy.name == "float32"
    assert model.get_layer("bn").dtype_policy.name == "mixed_float16"

    # The layers' variables, as the file holds them (saved under the
    # wrapper's class-based paths).
    for layer in LAYERS_IN_FILE:
        saved = _layer_arrays(path, layer)
        loaded = [_numpy(v) for v in model.get_layer(layer).variables]
        assert len(loaded) == len(saved), layer
        for value, array in zip(loaded, saved):
            np.testing.assert_array_equal(value, array, err_msg=layer)

    predictions = model.predict(expected["x"][:16], verbose=0)
    plain = _plain_model(path).predict(expected["x"][:16], verbose=0)
    np.testing.assert_array_equal(predictions, plain)
    np.testing.assert_allclose(predictions, expected["predictions"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(_numpy(model.scaling_state.scales), expected["scales"])
    assert int(_numpy(model.optimizer.iterations)) == int(expected["iterations"])
    assert float(_numpy(model.optimizer.dynamic_scale)) == float(expected["global_scale"])
    # Adam's slots and step count, read from the file itself.
    saved = _saved_arrays(path, "optimizer/inner_optimizer/vars")
    loaded = [_numpy(v) for v in model.optimizer.inner_optimizer.variables]
    assert len(loaded) == len(saved)
    for value, array in zip(loaded, saved):
        np.testing.assert_array_equal(value, array)


@pytest.mark.parametrize("version", ["0.2", "0.5"])
def test_a_loaded_older_file_trains_on_and_saves_in_todays_layout(mixed, version, tmp_path):
    expected = _expected(version)
    model = keras.models.load_model(os.path.join(HERE, f"tf_als-{version}.keras"))
    kernel = _numpy(model.get_layer("d2").kernel).copy()

    history = model.fit(expected["x"], expected["y"], batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    # Four more steps from where the file left off, none of them skipped
    # (the data has no inf now).
    assert int(_numpy(model.optimizer.iterations)) == int(expected["iterations"]) + 4
    assert not np.array_equal(_numpy(model.get_layer("d2").kernel), kernel)

    path = str(tmp_path / "again.keras")
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
    # Today's layout: the user's model itself, not a wrapper holding it.
    assert config["class_name"] == "Functional" and "model" not in config["config"]
    again = keras.models.load_model(path)
    np.testing.assert_array_equal(
        again.predict(expected["x"], verbose=0), model.predict(expected["x"], verbose=0)
    )
    np.testing.assert_array_equal(
        _numpy(again.scaling_state.records), _numpy(model.scaling_state.records)
    )
    assert [p.layer for p in tf_als.promoted(again)] == ["d1"]
