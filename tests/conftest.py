"""Shared test setup: quiet TensorFlow, a clean Keras state per test, the
global dtype policy restored after every test, and the models each test
module traced released when it ends."""

import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402
from tensorflow.python.framework import ops  # noqa: E402


# The slow suite's longest tests, longest first, with their durations on
# the two shared CI cores (seconds, 2026-12-07). pytest-xdist hands tests to
# its two workers in collection order, two or three ahead of the one
# running, so one of these near the end of the order (ConvNeXtTiny's skips
# test is the last of tests/training/test_skips.py) runs alone while the
# other worker has finished. Run first, they are spread over both workers
# and the short tests fill in after them. A prefix matches every
# parametrisation.
LONGEST_FIRST = (
    "tests/failures/test_failures.py::test_the_float16_softmax_top_of_efficientnet",  # 423
    "tests/test_demo.py::test_default_demo_shows_both_things_tf_als_does",  # 239
    "tests/failures/test_failures.py::test_tf_als_trains_like_the_manual_fix[soft_dice]",  # 236
    "tests/failures/test_failures.py::test_tf_als_trains_like_the_manual_fix[instance_norm]",  # 230
    "tests/model/test_properties.py::test_gradient_oracle_many",  # 217 and 190
    "tests/test_oracle.py::test_inner_optimizer_receives_float32_faithful_gradients[densenet121",  # 186
    "tests/training/test_skips.py::test_convnext_skips_no_more_than_keras",  # 177
    "tests/monitoring/test_report.py::test_works_on_keras_applications[ConvNeXtTiny]",  # 177
    "tests/test_gpu_check.py::test_gpu_check_prints_its_table_on_a_cpu",  # 166
)


def pytest_collection_modifyitems(config, items):
    """Moves the tests of `LONGEST_FIRST` to the front, in its order (a
    stable sort: everything else keeps its collection order)."""

    def rank(item):
        for i, prefix in enumerate(LONGEST_FIRST):
            if item.nodeid.startswith(prefix):
                return i
        return len(LONGEST_FIRST)

    items.sort(key=rank)


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
