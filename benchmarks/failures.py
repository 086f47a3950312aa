"""Float16 failures of the kind users report, four ways: float32, Keras's
`LossScaleOptimizer`, the manual fix (with Keras's optimizer) and tf_als
with its defaults, seed by seed (`tests/failure_cases.py` builds them).

For every run it prints and writes (`benchmarks/results/failures.md` and
`.json`): the held-out metric (R2 for `dollars`, IoU for the segmentation
cases, accuracy for `softmax_top`, next-character accuracy for
`gpt2_mask`), the steps skipped, the layers promoted
and the final global scale.

    python benchmarks/failures.py                    # every case, 3 seeds
    python benchmarks/failures.py dollars soft_dice  # some cases
    python benchmarks/failures.py --seeds 0          # one seed
    python benchmarks/failures.py noisy_or --output failures_noisy_or

The cases rebuilt from public reports (`failure_cases.REPORTED`: `noisy_or`,
`exp_loss`, `variance_norm`, and `gpt2_mask`'s attention inside a
KerasHub-style block, `gpt2_mask_block`, and in a subclassed model,
`gpt2_mask_subclassed`) run only when named; the slow suite does not run
them.

Every case but `softmax_top` takes well under a minute per seed on two CPU
cores; `softmax_top` (EfficientNetV2B0) takes a few minutes per seed.
"""

import argparse
import json
import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv=None):
    from tests import failure_cases

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cases = {**failure_cases.CASES, **failure_cases.REPORTED}
    parser.add_argument("cases", nargs="*", choices=[[]] + list(cases))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--output", default="failures")
    args = parser.parse_args(argv)
    names = args.cases or list(failure_cases.CASES)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for name in names:
        for seed in seeds:
            for method in failure_cases.METHODS:
                result = failure_cases.run(cases[name], method, seed)
                row = {
                    "case": name,
                    "seed": seed,
                    "method": method,
                    "metric": result.metric,
                    "skipped": result.skipped,
                    "promoted": list(result.promoted),
                    "scale": result.scale,
                }
                rows.append(row)
                print(_line(row), flush=True)
    _write(rows, args.output)


def _line(row) -> str:
    return (
        f"| {row['case']} | {row['seed']} | {row['method']} | "
        f"{_metric(row['metric'])} | {row['skipped']} | "
        f"{', '.join(row['promoted']) or '-'} | {_scale(row['scale'])} |"
    )


def _metric(value) -> str:
    return "NaN" if not math.isfinite(value) else f"{value:.3f}"


def _scale(value) -> str:
    if value <= 0:
        return "0"
    exponent = math.log2(value)
    return f"2**{exponent:.0f}" if exponent == round(exponent) else f"{value:g}"


def _write(rows, output):
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, output + ".json"), "w") as f:
        json.dump(rows, f, indent=1)
    header = (
        "| case | seed | run | held-out metric | skipped | promoted | final S |\n"
        "| --- | --- | --- | --- | --- | --- | --- |\n"
    )
    with open(os.path.join(RESULTS, output + ".md"), "w") as f:
        f.write("Written by `python benchmarks/failures.py`.\n\n")
        f.write(header + "\n".join(_line(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
