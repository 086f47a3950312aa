"""A ceiling on the ops tf_als adds to the traced train step, so that no
change grows it unseen (`benchmarks/op_count.py` prints the whole count).

The count is deterministic: the same code traces the same graph. The
ceilings are this code's count on the 3-block CNN (7 scaling points):
lower them as the backward pass sheds ops; a change that raises them must
say why (issue: at most about 20 extra ops per point, constants not
counted, and a few functions in all, not one per point)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import op_count  # noqa: E402

# Measured on this code: 60.0 extra non-constant ops per point and 10
# functions in the step's library (Keras's step has 4; tf_als adds the
# optimizer's telemetry branch, the forward headroom's branch, whose two
# functions every point with a float16 output shares, and the compiled
# choice, one function per gradient dtype that every point shares).
MAX_EXTRA_OPS_PER_POINT = 60
MAX_FUNCTIONS = 10
# Of those 60, the ops dispatched one by one (outside the compiled choice,
# whose ops run as one program): 54.
MAX_DISPATCHED_PER_POINT = 54


def test_the_cnn_step_stays_within_the_op_ceiling():
    result = op_count.measure("cnn")
    keras_ops, als_ops = result["keras"]["ops"], result["tf_als"]["ops"]
    points = result["points"]
    assert points == 7  # 3 convolutions, 3 BatchNormalizations, the head.
    extra = sum(als_ops.values()) - sum(keras_ops.values())
    extra -= als_ops["Const"] - keras_ops["Const"]
    assert extra > 0  # A count that found no tf_als op measured nothing.
    assert extra / points <= MAX_EXTRA_OPS_PER_POINT, extra / points
    dispatched = extra - (result["tf_als"]["compiled"] - result["keras"]["compiled"])
    assert dispatched / points <= MAX_DISPATCHED_PER_POINT, dispatched / points
    assert result["keras"]["functions"] <= 4
    assert result["tf_als"]["functions"] <= MAX_FUNCTIONS
    # The parts tf_als names are found (the per-part split in the report).
    assert {"choice", "forward", "update"} <= set(result["tf_als"]["parts"])
