"""Why `overhead.py` has no GPT-2 row under MirroredStrategy.

Trains the tiny KerasHub GPT-2 classifier of `overhead.py` for four steps
under `MirroredStrategy` on two logical CPUs, once with Keras's
`LossScaleOptimizer` and once with tf_als, and prints, after each step, the
loss, the steps applied and the trainable variables that are no longer
finite. On this project's machine both runs skip their first two steps. At
the third, only the second replica's gradients overflow: Keras decides from
the first replica's and applies the step, writing inf into the biases of
the output projections that feed the residual adds; tf_als's replicas agree
first (one scalar all-reduce per step), skip it, and apply the fourth with
finite weights. Keras's side of an overhead ratio would time a broken run,
so the overhead benchmark leaves the model out.

    python benchmarks/mirrored_gpt2.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overhead  # noqa: E402


def main():
    overhead._configure("mirrored")
    import numpy as np

    strategy = overhead._strategy("mirrored")
    for variant in ("keras", "tf_als"):
        model, x, y, batch = overhead.make(variant, "gpt2", False, 20, 4, strategy, None)
        for step in range(4):
            history = model.fit(overhead.dataset(x, y, batch, 1), verbose=0)
            broken = [
                v.path
                for v in model.trainable_variables
                if not np.all(np.isfinite(v.numpy()))
            ]
            print(
                f"{variant}: step {step}, loss {history.history['loss'][0]:.4g}, "
                f"applied {int(model.optimizer.iterations.numpy())}, "
                f"non-finite variables {broken}",
                flush=True,
            )


if __name__ == "__main__":
    main()
