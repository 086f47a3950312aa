"""Shared test setup: quiet TensorFlow, a clean Keras state per test, and the
global dtype policy restored after every test."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402


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
