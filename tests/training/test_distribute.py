"""Training under `tf.distribute.MirroredStrategy` on two logical CPU
devices, with `fit` and with a custom loop (`strategy.run` of a step doing
GradientTape, `optimizer.scale_loss` and `optimizer.apply`), compared with
the same training on a single device.

Logical devices must be configured before TensorFlow initialises its
devices, which this process did long ago, so each scenario runs in its own
process (`tests/distributed_run.py`; both start at once and run side by
side), which trains the single-device reference and the mirrored run from
the same initial weights on the same global batches (shuffle=False, SGD)
and prints JSON.

The model (Dense, synchronized BatchNormalization, a residual fork, a
float32 head) is trained on a loss multiplied by 2**-12 with
`telemetry_interval=2` and `max_layer_scale=8`, so that the per-layer
scales leave 1 and differ between points. The first replica's examples
weigh 16 times the second's: each replica's points choose their scales from
its own gradients, so the replicas choose differently, and the run must
still end where the single device ends. That is sound because each
replica's weight gradients are unscaled, per call and in float32, before
Keras sums them (docs/distributed.md): what is summed is S times the true
gradient on every replica, whatever scales each chose.

`test_multi_worker_custom_loop` (marked slow) runs the custom loop under
MultiWorkerMirroredStrategy: two worker processes on 127.0.0.1.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

# One pytest-xdist worker runs the whole module: its module fixture starts
# both scenarios' subprocesses, which every worker running one of its tests
# would start again.
pytestmark = pytest.mark.xdist_group("distribute")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ("fit", "loop")
REPLICAS = 2
STEPS = 6
INTERVAL = 2
# Each process needs ~20 s of CPU (TensorFlow's import and the first trace of
# each run dominate); the bound leaves room for a loaded machine.
TIMEOUT = 300

# Final weights: |mirrored - single| <= WEIGHT_TOLERANCE * max |single -
# initial|, per variable, i.e. relative to how far the variable moved (the
# initial weights are identical, so only the updates can differ). The runs
# differ only by float16 rounding: each replica's layer computes its float16
# weight-gradient sums (and input gradients) over its half batch, rounded to
# float16 (relative error up to 2**-11 ~ 4.9e-4) before the float32 sum over
# replicas, where the single device rounds the sum over the whole batch once;
# synchronized BatchNormalization likewise sums its statistics in another
# order. Six steps carry those roundings into the weights (and BN's moving
# statistics). Measured (2 replicas, TF 2.21 CPU): max difference 1.9e-4
# (dense/kernel, whose update reaches 0.24), 8.1e-4 of the update, identical
# for fit and the custom loop; 4.8e-4 to 9.3e-4 over three other data seeds.
# 2**-8 ~ 3.9e-3 leaves a factor of four; a real error, such as a gradient
# off by a power of two (a loss not divided by the replica count, a wrong
# unscale), changes an update by 50% or more.
WEIGHT_TOLERANCE = 2.0**-8


def _start(*args):
    """Starts `python -m tests.distributed_run *args`; its output goes to
    temporary files (no pipe to drain while waiting on the others)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.distributed_run", *args],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=err,
        text=True,
    )
    return process, out, err


def _collect(started):
    """`{key: JSON result, or a str saying how the process failed}` of
    `{key: _start(...)}`. Waits at most TIMEOUT, and stops waiting as soon
    as one process fails (a multi-worker peer would wait for it forever);
    kills whatever still runs."""
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline:
            codes = [process.poll() for process, _, _ in started.values()]
            if None not in codes or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.1)
        results = {}
        for key, (process, out, err) in started.items():
            code = process.poll()
            if code is None:
                results[key] = (
                    f"was killed (not done after {TIMEOUT} s, or a peer failed)"
                )
            elif code != 0:
                err.seek(0)
                results[key] = f"exited with {code}:\n{err.read()[-6000:]}"
            else:
                out.seek(0)
                results[key] = json.loads(out.read().strip().splitlines()[-1])
        return results
    finally:
        for process, out, err in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()
            out.close()
            err.close()


@pytest.fixture(scope="module")
def scenarios():
    """Both scenarios, run side by side."""
    return _collect(
        {mode: _start(mode, "--replicas", str(REPLICAS)) for mode in MODES}
    )


@pytest.fixture(params=MODES)
def run(request, scenarios):
    result = scenarios[request.param]
    if isinstance(result, str):
        pytest.fail(f"{request.param} scenario {result}")
    return result


def test_runs_on_two_replicas(run):
    assert run["replicas"] == REPLICAS
    assert len(run["devices"]) == REPLICAS
    for key in ("single", "mirrored"):
        assert run[key]["iterations"] == STEPS
        assert len(run[key]["per_step"]) == STEPS


def test_every_replica_records_on_the_same_steps(run):
    _check_replicas_record(run)


def test_replicas_choose_their_own_scales(run):
    _check_own_scales(run)


def test_scales_leave_one_and_the_global_scale_agrees(run):
    _check_scales(run)


def test_weights_equal_the_single_device_run(run):
    _check_weights(run)


def test_one_flag_per_step_and_no_other_exchange(run):
    """tf_als's collectives: one all-reduce of a scalar per replica and
    trace, on every step, so that all replicas agree whether the step's
    gradients are finite (`replicas.agree`), and
    nothing else: the points choose from their replica's own gradients,
    and the telemetry records each replica's own. Keras's gradient
    all-reduce does not go through the replica context's methods;
    synchronized BatchNormalization's all-reduces do, of its [1, channels]
    moments, and are left aside."""
    flags = [
        c for c in run["mirrored"]["collectives"]
        if c["kind"] == "all_reduce" and c["shapes"] == [[]]
    ]
    assert len(flags) == REPLICAS, run["mirrored"]["collectives"]
    assert not any("cond" in f["graph"] for f in flags), flags
    gathers = [c for c in run["mirrored"]["collectives"] if c["kind"] == "all_gather"]
    assert not gathers, gathers
    gradient_sum = [list(shape) for shape in run["mirrored"]["trainable_shapes"]]
    others = [
        c for c in run["mirrored"]["collectives"]
        if c["kind"] == "all_reduce" and c["shapes"] not in ([[]], gradient_sum)
        and not all(len(shape) == 2 and shape[0] == 1 for shape in c["shapes"])
    ]
    assert not others, others


@pytest.mark.slow
def test_multi_worker_custom_loop():
    """MultiWorkerMirroredStrategy: two worker processes (one CPU replica
    each) on 127.0.0.1, the custom loop. (Keras 3's `fit` does not run under
    MultiWorkerMirroredStrategy at all, even for a plain model: "Attempt to
    convert a value (PerReplica...)", keras-team/keras#20585.)"""
    sockets = [socket.socket() for _ in range(REPLICAS)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    workers = ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in sockets)
    for s in sockets:
        s.close()
    results = _collect(
        {
            index: _start("loop", "--workers", workers, "--index", str(index))
            for index in range(REPLICAS)
        }
    )
    for index, result in results.items():
        if isinstance(result, str):
            pytest.fail(f"worker {index} {result}")
    chief = results[0]
    assert chief["replicas"] == REPLICAS
    assert chief["mirrored"]["iterations"] == STEPS
    # Every worker holds one replica: gather them as one run's replicas.
    per_step = [
        [
            {
                name: [
                    results[i]["mirrored"]["per_step"][step][k][name][0]
                    for i in range(REPLICAS)
                ]
                for name in ("scale", "record", "last_update")
            }
            for k in range(len(chief["mirrored"]["per_step"][step]))
        ]
        for step in range(STEPS)
    ]
    run = dict(chief, mirrored=dict(chief["mirrored"], per_step=per_step))
    _check_replicas_record(run)
    _check_own_scales(run)
    _check_scales(run)
    _check_weights(run)
    for index in range(1, REPLICAS):
        assert results[index]["mirrored"]["weights"] == chief["mirrored"]["weights"]


def _check_replicas_record(run):
    """Every replica records its telemetry on the same steps (0, 2, 4),
    and every point's gradients carry T_in >= 1 on every replica."""
    mirrored = run["mirrored"]["per_step"]
    assert len(mirrored) == len(run["single"]["per_step"]) == STEPS
    for step, points in enumerate(mirrored):
        for k, point in enumerate(points):
            where = f"step {step}, point {k}"
            assert len(point["last_update"]) == REPLICAS, where
            assert point["last_update"] == [step - step % INTERVAL] * REPLICAS, where
            assert all(r[0] >= 1.0 for r in point["record"]), where


def _check_own_scales(run):
    """The replicas' scales differ at some point and step: each chose
    from its own gradients (the first replica's are 2**4 larger)."""
    differ = [
        (step, k, point["scale"])
        for step, points in enumerate(run["mirrored"]["per_step"])
        for k, point in enumerate(points)
        if len(set(point["scale"])) > 1
    ]
    assert differ, "every replica chose the same scales at every step"


def _check_scales(run):
    single, mirrored = run["single"], run["mirrored"]
    # The scales left 1 at more than one point (so the fork around the
    # residual rescales).
    assert sum(s > 1.0 for s in mirrored["scales"].values()) >= 2
    assert sum(s > 1.0 for s in single["scales"].values()) >= 2
    assert all(s["cumulative_scale"] >= 1.0 for s in mirrored["states"])
    assert {s["last_update"] for s in mirrored["states"]} == {4}
    assert mirrored["dynamic_scale"] == single["dynamic_scale"]
    assert mirrored["iterations"] == single["iterations"] == STEPS


def _check_weights(run):
    single, mirrored = run["single"], run["mirrored"]
    names = single["weight_names"]
    assert mirrored["weight_names"] == names
    for name, initial, expected, actual in zip(
        names, run["initial_weights"], single["weights"], mirrored["weights"]
    ):
        initial, expected, actual = (
            np.asarray(w, np.float32) for w in (initial, expected, actual)
        )
        moved = np.abs(expected - initial).max()
        # Every variable moved well beyond the tolerance's reach.
        assert moved > 1e-3, name
        np.testing.assert_allclose(
            actual, expected, rtol=0, atol=WEIGHT_TOLERANCE * moved, err_msg=name
        )


@pytest.mark.slow
def test_a_gan_on_two_replicas():
    """The GAN step of tests/loops.py (two instrumented models, two
    optimizers, the generator inside the critic's tape and the critic
    inside the generator's) under MirroredStrategy: every replica records
    on the same steps, and the run ends where the single-device run ends
    (tolerance: WEIGHT_TOLERANCE, as above), whatever scales each replica
    chose from its own noise."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    done = subprocess.run(
        [sys.executable, "-m", "tests.distributed_gan"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("generator", "critic"):
        single, mirrored = result["single"][name], result["mirrored"][name]
        assert mirrored["iterations"] == single["iterations"] == 6
        last = mirrored["replicas"]["last_updates"]
        assert last == [[4] * len(single["scales"])] * REPLICAS, (name, last)
        for got, want, start in zip(mirrored["weights"], single["weights"], single["initial"]):
            got, want, start = np.asarray(got), np.asarray(want), np.asarray(start)
            moved = np.abs(want - start).max()
            assert moved > 0, name
            assert np.abs(got - want).max() <= WEIGHT_TOLERANCE * moved, name
