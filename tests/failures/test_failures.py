"""Float16 failures of the kind users report (`tests/failure_cases.py`),
trained from the same weights on the same batches: float32, the manual fix
(with Keras's `LossScaleOptimizer`) and tf_als with its defaults, over
three seeds. Keras's own run is in `benchmarks/failures.py`'s table (it
ends in NaN or without learning in every case); it decides nothing here.

For every case and seed, tf_als:
- ends with a held-out metric within float32's seed-to-seed spread: no
  lower than the worst float32 seed by more than the spread itself (or
  `METRIC_SLACK`, when the spread is smaller);
- skips at most `EXTRA_SKIPS` more steps than the manual fix;
- promotes only layers the fix puts in float32 (the layers that fail).
"""

import functools

import numpy as np
import pytest

from tests import failure_cases

SEEDS = (0, 1, 2)
# Skips allowed beyond the manual fix's: the fix starts at Keras's 2**15 and
# halves into place; tf_als chooses its first scale on the first batch, and
# then halves like Keras as the weights grow (measured: at most 11 against
# the fix's 26-28 in `dollars`).
EXTRA_SKIPS = 3
# Metric slack when float32's seeds agree more closely than this.
METRIC_SLACK = 0.02

# Layers each case's manual fix computes in float32.
FIXED = {
    "dollars": {"price"},
    "instance_norm": {"norm_0", "norm_1", "norm_2"},
    "soft_dice": {"mask"},
    "softmax_top": {"predictions"},
    # The fix changes these layers' own code (the mask constant); tf_als
    # computes them, sublayers included, in float32.
    "gpt2_mask": {"attn_0", "attn_1"},
}


@functools.lru_cache(maxsize=None)
def result(name, method, seed):
    return failure_cases.run(failure_cases.CASES[name], method, seed)


def _check(name, seeds, slack=METRIC_SLACK):
    float32 = [result(name, "float32", s).metric for s in seeds]
    spread = max(max(float32) - min(float32), slack)
    for seed in seeds:
        fix, ours = result(name, "fix", seed), result(name, "tf_als", seed)
        assert np.isfinite(ours.metric), (seed, ours)
        assert ours.metric >= min(float32) - spread, (seed, ours.metric, float32)
        assert ours.skipped <= fix.skipped + EXTRA_SKIPS, (seed, ours, fix)
        assert ours.promoted, (seed, ours)
        assert set(ours.promoted) <= FIXED[name], (seed, ours.promoted)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dollars", "instance_norm", "soft_dice", "gpt2_mask"])
def test_tf_als_trains_like_the_manual_fix(mixed, name):
    _check(name, SEEDS)


# float32's held-out accuracy over seeds 0-2 in `softmax_top` (24 steps of
# EfficientNetV2B0 from random weights: near chance, and noisy), measured by
# `python benchmarks/failures.py softmax_top`
# (benchmarks/results/failures.md): 0.141, 0.250 and 0.156, a
# spread of 0.11.
SOFTMAX_SPREAD = 0.11


@pytest.mark.slow
def test_the_float16_softmax_top_of_efficientnet(mixed):
    """One seed (each run of EfficientNetV2B0 costs one to four minutes on
    two CPU cores; the benchmark runs three), against float32's spread over
    three. The accuracy after 24 steps says little; what fails here is the
    scale: Keras's run halves below 1 and ends NaN, tf_als's stays at 1 or
    above once the classifier computes in float32."""
    _check("softmax_top", (0,), slack=SOFTMAX_SPREAD)
    assert result("softmax_top", "tf_als", 0).scale >= 1.0


@pytest.mark.slow
def test_keras_fails_where_tf_als_does_not(mixed):
    """The premise, on the cheapest case: Keras's `LossScaleOptimizer` loses
    the dollar regression (its scale halves to its floor of 0 and the
    weights end NaN), tf_als promotes the output layer before the first
    step and ends within 2% of float32's R2."""
    keras_run = failure_cases.run(failure_cases.DOLLARS, "keras", 0)
    ours = result("dollars", "tf_als", 0)
    reference = result("dollars", "float32", 0)
    assert not np.isfinite(keras_run.metric)
    assert keras_run.scale == 0.0
    assert ours.promoted == ("price",)
    assert abs(ours.metric - reference.metric) <= 0.02, (ours.metric, reference.metric)
