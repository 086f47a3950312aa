"""Shared test setup: quiet TensorFlow, a clean Keras state per test, the
global dtype policy restored after every test, and the models each test
module traced released when it ends."""

import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402
from tensorflow.python.framework import ops  # noqa: E402


def pytest_collection_finish(session):
    """Moves what importing TensorFlow, Keras, KerasHub and the test
    modules made (about 450,000 objects that live as long as the process)
    out of the garbage collector's reach (`gc.freeze`): every full
    collection after that scans only what the tests make. Measured with
    `gc.callbacks` on `tests/model/test_composite.py` and
    `tests/failures/test_promote.py`, serially, with a benchmark sharing
    the cores: the full collections took 17.5 s of the 148 s, and 8.2 s
    frozen."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _release_traced_models():
    """Releases what the module's traces pinned, after its last test.

    Every `tf.custom_gradient` traced in graph mode (each scaling point of
    an instrumented model in a `tf.function`) registers its gradient
    function in TensorFlow's global gradient registry and never removes it
    (tensorflow/tensorflow#27492, #97697). That function's closure holds the
    traced graph and, through tf_als's backward pass, the model, its
    optimizer and their variables: without this, nothing a test traces is
    ever freed. Measured on the default suite, serially: 3.8 M live Python
    objects, 5,200 functions in TensorFlow's context and 4.9 GiB resident
    by the end (13 GiB at the end of the slow suite), and full garbage
    collections that stalled single tests for up to 40 s.

    Entries are removed per module, not per test, because a module-scoped
    fixture's model may be differentiated again by a later test of its
    module. Reads TensorFlow's private `ops._gradient_registry`; the entries
    it adds are named "CustomGradient-<uid>" (TensorFlow 2.21)."""
    registry = ops._gradient_registry._registry
    before = set(registry)
    yield
    for name in set(registry) - before:
        if name.startswith("CustomGradient-"):
            del registry[name]
    gc.collect()


@pytest.fixture(autouse=True)
def _clean_keras():
    """Every test starts from float32, fresh layer names and seed 0, and
    leaves the global policy as it found it. (`free_memory=False`: the
    garbage collection it would run costs ~0.4 s per test.)"""
    policy = keras.mixed_precision.global_policy()
    keras.backend.clear_session(free_memory=False)
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    yield
    keras.mixed_precision.set_global_policy(policy)


@pytest.fixture
def mixed():
    """Sets the mixed_float16 policy for the test."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
