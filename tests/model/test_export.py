"""Serving an instrumented model: `model.export` (with and without an
`input_signature`) and `tf.saved_model.save` write artifacts that serve the
plain forward pass, with no custom gradients, load in a process that never
imports tf_als, and return exactly what `predict` returns (bitwise on CPU:
the same float16 kernels run the same graph-mode computation)."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_als
from tf_als._src.model import graph as graph_module
from tests import architectures
from tests.model import test_composite

CASES = [
    c for c in architectures.CASES
    # A residual CNN, an attention model with an Embedding, a subclassed one.
    if c.name in ("resnet", "transformer", "subclassed")
]

# Runs in a fresh interpreter: loads every artifact, serves the saved
# inputs, and reports per artifact whether the output equals the saved
# `predict` output bit for bit, whether its graph holds custom gradients,
# and whether tf_als was imported.
_SERVE = textwrap.dedent(
    """
    import json, pathlib, sys
    import numpy as np
    import tensorflow as tf

    results = {}
    for directory in sys.argv[1:]:
        artifact = tf.saved_model.load(directory)
        x = np.load(directory + ".x.npy")
        if hasattr(artifact, "serve"):
            out = artifact.serve(tf.constant(x))
        else:
            outputs = artifact.signatures["serving_default"](tf.constant(x))
            (out,) = outputs.values()
        expected = np.load(directory + ".expected.npy")
        graph = pathlib.Path(directory, "saved_model.pb").read_bytes()
        results[directory] = dict(
            equal=bool(np.array_equal(np.asarray(out), expected)),
            custom_gradients=b"CustomGradient" in graph,
        )
    results["tf_als_imported"] = "tf_als" in sys.modules
    print(json.dumps(results))
    """
)


def _serve(directories):
    """Runs `_SERVE` on `directories` in a fresh Python process."""
    completed = subprocess.run(
        [sys.executable, "-c", _SERVE, *directories],
        capture_output=True,
        text=True,
        cwd="/",
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-2500:]
    import json

    return json.loads(completed.stdout.strip().splitlines()[-1])


def _trained(case):
    instrumented, x, y = test_composite._trainable(case)
    instrumented.fit(x, y, epochs=2, batch_size=len(y), verbose=0)
    return instrumented, x


@pytest.mark.parametrize(
    "names",
    [
        # The subclassed model (whose artifact Keras signs in float16) in
        # the default suite; the residual CNN and the attention model with
        # an Embedding in the slow one (about 30 s more).
        ("subclassed",),
        pytest.param(("resnet", "transformer"), marks=pytest.mark.slow),
    ],
    ids=["subclassed", "resnet-transformer"],
)
def test_exported_artifacts_serve_predict_exactly_without_tf_als(mixed, tmp_path, names):
    directories = []
    cases = [c for c in CASES if c.name in names]
    assert len(cases) == len(names)
    for case in cases:
        instrumented, x = _trained(case)
        expected = instrumented.predict(x, verbose=0)
        spec = tf.TensorSpec((None,) + x.shape[1:], tf.as_dtype(x.dtype))
        writers = {
            "export": lambda path: instrumented.export(path, verbose=False),
            "export_signature": lambda path: instrumented.export(
                path, input_signature=[spec], verbose=False
            ),
            "saved_model": lambda path: tf.saved_model.save(instrumented, path),
        }
        for how, write in writers.items():
            directory = str(tmp_path / f"{case.name}_{how}")
            write(directory)
            served = x
            if how != "export_signature" and graph_module.is_subclassed(
                instrumented.uninstrumented()
            ):
                # Keras signs a subclassed model's artifact with the
                # model's input dtype, float16 under mixed_float16 (a
                # plain subclassed model too); its first layer casts the
                # float32 batch `predict` gets to the same float16 values.
                served = x.astype(instrumented.uninstrumented().input_dtype)
            np.save(directory + ".x.npy", served)
            np.save(directory + ".expected.npy", expected)
            directories.append(directory)
    results = _serve(directories)
    assert results.pop("tf_als_imported") is False
    failures = {d: r for d, r in results.items() if not r["equal"] or r["custom_gradients"]}
    assert not failures, failures
    assert len(results) == 3 * len(cases)


def test_the_instrumented_model_keeps_its_custom_gradients(mixed):
    """The check above would pass vacuously if nothing ever held custom
    gradients: tracing the instrumented model's own call does."""
    _, model = CASES[0].build_pair()
    x, _ = CASES[0].data()
    instrumented = tf_als.instrument(model)

    @tf.function
    def forward(x):
        return instrumented(x, training=True)

    graph = forward.get_concrete_function(tf.constant(x)).graph.as_graph_def()
    assert b"CustomGradient" in graph.SerializeToString()


class _Chatty(keras.layers.Layer):
    """A user's layer that prints whenever its call is traced."""

    def call(self, x):
        print("chatty layer traced")
        return x


def test_export_prints_its_endpoint_without_a_line_per_variable(mixed, tmp_path, capsys):
    """Keras's `export` lists every captured variable ("Captures:", one
    line per weight: 10 here, dozens in a real model); the instrumented
    model's names its endpoint in one line, and a user's own output while
    the forward pass is traced still shows."""
    inputs = keras.Input((8,))
    x = inputs
    for _ in range(4):
        x = keras.layers.Dense(8, activation="relu")(x)
    x = _Chatty()(x)
    model = keras.Model(inputs, keras.layers.Dense(2, dtype="float32")(x))
    instrumented = tf_als.instrument(model)
    capsys.readouterr()
    model.export(str(tmp_path / "plain"))
    keras_says = capsys.readouterr().out
    assert keras_says.count("dtype=tf.resource") == len(model.weights)  # premise
    instrumented.export(str(tmp_path / "default"))
    out = capsys.readouterr().out
    assert "Captures" not in out and "tf.resource" not in out, out
    lines = [line for line in out.splitlines() if line != "chatty layer traced"]
    assert lines == [
        f"Saved artifact at '{tmp_path / 'default'}', endpoint 'serve': "
        "(args_0: TensorSpec(shape=(None, 8), dtype=tf.float32, "
        "name='keras_tensor'), /) -> TensorSpec(shape=(None, 2), "
        "dtype=tf.float32, name=None)"
    ]
    assert "chatty layer traced" in out  # the user's own print
    instrumented.export(str(tmp_path / "quiet"), verbose=False)
    assert set(capsys.readouterr().out.splitlines()) == {"chatty layer traced"}
    x = np.ones((3, 8), "float32")
    for name in ("plain", "default", "quiet"):
        artifact = tf.saved_model.load(str(tmp_path / name))  # kept: it owns
        served = artifact.serve(tf.constant(x))  # the variables `serve` reads
        np.testing.assert_array_equal(served.numpy(), model.predict(x, verbose=0))
