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

Tolerances: none. The loaded model computes the same float16 operations
on the same weights as the version that wrote the file, and these CPU
runs are bitwise reproducible, so predictions are compared bit for bit;
saved variables are compared with the file's bytes.
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

    predictions = model.predict(expected["x"][:16], verbose=0)
    np.testing.assert_array_equal(predictions, expected["predictions"])
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
