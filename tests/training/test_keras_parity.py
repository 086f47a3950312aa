"""Keras's own tests of `LossScaleOptimizer`, run against
`tf_als.AdaptiveLossScaleOptimizer`.

Keras ships them in site-packages
(`keras/src/optimizers/loss_scale_optimizer_test.py`, Keras 3.15.1). They
are imported, not copied: `KerasTestsOnOurs` inherits every test method of
Keras's `LossScaleOptimizerTest`, and for each test the module's global
`LossScaleOptimizer`, the name its tests construct, is replaced by tf_als's
class (restored afterwards). Keras's `TestCase.setUp` clears the session
first, as for Keras's own run.

Of Keras's 29 test cases (`pytest -rA` on this module):

- 21 pass as they are: the config and serialization round trips
  (`run_class_serialization_test`), apply without variables, a finite and
  an infinite step, a step with the inner optimizer's own loss scale
  factor, `overwrite_with_gradient`, downscaling and upscaling of S, the
  iteration count, `dynamic=True/False`, unsupported arguments all named
  (`foo`, `bar`), the base optimizer's 9 arguments refused, and an old
  config that carries them.
- 7 are skipped by Keras itself on the TensorFlow backend (the
  `stateless` variants: "stateless_apply is not supported with the TF
  backend").
- 1 cannot pass by design, marked `xfail(strict=True)` below:
  `test_serialization` asserts that `get_config()` has exactly 4 keys
  (it fails with "12 != 4"); tf_als's config extends the parent's 4 with
  its 8 own (DESIGN.md, "Config": the subclass adds its own keys to the
  parent's). The rest of that test (name, initial_scale,
  dynamic_growth_steps, inner_optimizer, from_config) is checked in
  test_optimizer.py.
"""

import keras
import keras.src.optimizers.loss_scale_optimizer_test as keras_tests
import pytest

import tf_als

EXPECTED_FAILURES = {
    "test_serialization": (
        "Keras asserts get_config() has exactly 4 keys; tf_als adds its 8 "
        "(rule, telemetry_interval, update_interval, underflow_rate, "
        "max_layer_scale, overflow_margin, max_consecutive_skips, "
        "promote_on_storm) to the parent's 4 by design"
    ),
}


class KerasTestsOnOurs(keras_tests.LossScaleOptimizerTest):
    """Keras's `LossScaleOptimizerTest`, with tf_als's class under test."""

    def setUp(self):
        super().setUp()
        original = keras_tests.LossScaleOptimizer
        keras_tests.LossScaleOptimizer = tf_als.AdaptiveLossScaleOptimizer
        self.addCleanup(setattr, keras_tests, "LossScaleOptimizer", original)


for _name, _reason in EXPECTED_FAILURES.items():
    setattr(
        KerasTestsOnOurs,
        _name,
        pytest.mark.xfail(reason=_reason, strict=True)(
            getattr(keras_tests.LossScaleOptimizerTest, _name)
        ),
    )


def test_the_tests_run_against_our_class(monkeypatch):
    """Guards the substitution: while a test runs, the name Keras's tests
    construct is tf_als's class, and afterwards it is Keras's again."""
    seen = []
    monkeypatch.setattr(
        KerasTestsOnOurs,
        "test_config",
        lambda self: seen.append(keras_tests.LossScaleOptimizer),
        raising=True,
    )
    result = KerasTestsOnOurs("test_config").run()
    assert result.wasSuccessful()
    assert seen == [tf_als.AdaptiveLossScaleOptimizer]
    assert keras_tests.LossScaleOptimizer is keras.optimizers.LossScaleOptimizer
