"""`benchmarks/gpu_check.py` runs end to end on the CPU (at its quick
size): the slow suite keeps the GPU check ready to run on a GPU."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_gpu_check_prints_its_table_on_a_cpu():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "device: CPU"
    rows = [line for line in lines if line.startswith("| cnn |")]
    # Each row once as it is measured, then in the final table.
    assert len(rows) == 4, done.stdout
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        ratios = [float(c.split()[0]) for c in cells[4:]]
        # Ratios of positive times and memories; anything else is a broken
        # measurement (a crashed worker, a zero time).
        assert all(0.1 < r < 10.0 for r in ratios), row
    assert "Peak memory: process RSS." in done.stdout
