"""The scripts in `examples/`: each trains for real in its `--quick` mode and
returns results that must show learning and valid per-layer scales.

The examples are loaded from their files (they are scripts, not a package).
`mirrored_strategy.py` runs in a subprocess: it must split the CPU into
logical devices before TensorFlow initialises, which this process has done.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

# One pytest-xdist worker runs the whole module: its module fixture starts
# the mirrored example's subprocess, which every worker running one of its
# tests would start again.
pytestmark = pytest.mark.xdist_group("examples")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples")
NAMES = (
    "quickstart_fit",
    "custom_training_loop",
    "resnet_cnn",
    "transformer_text",
    "mirrored_strategy",
)


def load(name: str):
    """Imports `examples/<name>.py` as a module (without running `main`)."""
    spec = importlib.util.spec_from_file_location(
        f"tf_als_example_{name}", os.path.join(EXAMPLES, f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ATTENTION_PROJECTIONS = ("query", "key", "value", "attention_output")


def weighted_layers(module) -> list:
    """Names of the example model's layers that own weights: tf_als makes a
    scaling point of each (each is called once in these models), and of
    each projection inside a MultiHeadAttention."""
    names = []
    for layer in module.build_model().layers:
        if layer.weights:
            names.append(layer.name)
        if isinstance(layer, keras.layers.MultiHeadAttention):
            names += [f"{layer.name}/{p}" for p in ATTENTION_PROJECTIONS]
    return names


def check_scales(scales: dict, module) -> None:
    assert sorted(scales) == sorted(weighted_layers(module))
    for name, scale in scales.items():
        # Below 1, a point gives back lift inherited from downstream
        # (T_in stays >= 1; tests/training/test_skips.py checks that).
        assert 0.0 < scale <= 2.0**15, (name, scale)
        assert math.log2(scale) == int(math.log2(scale)), (name, scale)


def check_learned(result: dict, min_accuracy: float) -> None:
    losses = result["losses"]
    assert all(np.isfinite(losses)) and np.isfinite(result["test_loss"])
    assert losses[-1] < losses[0], losses
    assert result["test_accuracy"] > min_accuracy, result["test_accuracy"]


def check_updates(result: dict, module) -> None:
    """ScaleHistory saw a scale update on every `telemetry_interval`-th
    optimizer step, first step included (a retried step repeats its
    number), and the global loss scale stayed a power of two."""
    interval = module.parse_args(["--quick"]).telemetry_interval
    assert result["steps"] > 0
    assert sorted(set(result["scale_updates"])) == list(
        range(0, result["steps"], interval)
    )
    assert math.log2(result["loss_scale"]) == int(math.log2(result["loss_scale"]))
    assert result["skipped_steps"] >= 0


@pytest.fixture(scope="module", autouse=True)
def mirrored_run(request, tmp_path_factory):
    """Starts `mirrored_strategy.py --quick` in a subprocess as soon as this
    module's tests begin (if its test is selected), so that it runs while
    the in-process examples trace their models (tracing is single-threaded).
    Yields `(process, directory)` (results.json and stderr.txt go there), or
    None."""
    names = {item.name for item in request.session.items}
    if "test_mirrored_strategy" not in names:
        yield None
        return
    directory = tmp_path_factory.mktemp("mirrored")
    command = [
        sys.executable, os.path.join(EXAMPLES, "mirrored_strategy.py"),
        "--quick", "--verbose", "0", "--json", str(directory / "results.json"),
    ]
    with open(directory / "stdout.txt", "w") as out, \
            open(directory / "stderr.txt", "w") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err)
    yield process, directory
    if process.poll() is None:
        process.kill()
        process.wait()


def test_quickstart_fit(tmp_path):
    example = load("quickstart_fit")
    log_dir = str(tmp_path / "logs")
    result = example.main(["--quick", "--verbose", "0", "--log-dir", log_dir])
    check_learned(result, min_accuracy=0.5)  # 10 classes
    check_scales(result["scales"], example)
    check_updates(result, example)
    events = os.listdir(os.path.join(log_dir, "tf_als"))
    assert any(name.startswith("events.out.tfevents") for name in events)


def test_custom_training_loop():
    example = load("custom_training_loop")
    result = example.main(["--quick"])
    check_learned(result, min_accuracy=0.5)  # 10 classes
    check_scales(result["scales"], example)
    check_updates(result, example)
    # Every batch ran one step: applied or skipped for non-finite gradients.
    args = example.parse_args(["--quick"])
    batches = len(example.load_digits()[0]) // args.batch_size  # full ones
    assert result["steps"] + result["skipped_steps"] == args.epochs * batches


@pytest.mark.slow  # ~45 s: the residual CNN example's quick run
def test_resnet_cnn():
    example = load("resnet_cnn")
    result = example.main(["--quick", "--verbose", "0"])
    check_learned(result, min_accuracy=0.35)  # 4 classes
    assert result["accuracies"][-1] > 0.6
    check_scales(result["scales"], example)
    check_updates(result, example)
    # Gradients reaching the last block are divided by the pooling window
    # (8x8) as well as the batch: the scaler lifts some of them.
    assert max(result["scales"].values()) > 1.0


def test_transformer_text():
    example = load("transformer_text")
    result = example.main(["--quick", "--verbose", "0"])
    check_learned(result, min_accuracy=0.7)  # 2 classes
    check_scales(result["scales"], example)
    check_updates(result, example)
    assert {"attention", "position_embedding", "ffn_norm"} <= set(result["scales"])


def test_mirrored_strategy(mirrored_run):
    example = load("mirrored_strategy")  # imports tensorflow only
    process, directory = mirrored_run
    if process.wait(timeout=300) != 0:
        stderr = (directory / "stderr.txt").read_text().splitlines()
        pytest.fail(
            f"mirrored_strategy.py exited with {process.returncode}:\n"
            + "\n".join(stderr[-15:])
        )
    with open(directory / "results.json") as handle:
        result = json.load(handle)
    assert result["replicas"] == 2
    check_learned(result, min_accuracy=0.5)  # 10 classes
    check_scales(result["scales"], example)
    check_updates(result, example)
    # Both replicas hold, and so applied, the same scales, updated at the
    # same last step.
    last = max(result["scale_updates"])
    for name, scale in result["scales"].items():
        assert result["replica_scales"][name] == [scale, scale], name
        assert result["replica_last_update"][name] == [last, last], name


def test_mirrored_refuses_an_initialised_runtime():
    """Once TensorFlow has set up one CPU device, the example cannot split
    it and says to run in a fresh process (as the test above does)."""
    import tensorflow as tf

    example = load("mirrored_strategy")
    tf.constant(0.0)  # initialises TensorFlow's devices in this process
    if len(tf.config.list_logical_devices("CPU")) >= 2:
        pytest.skip("this process already has two logical CPUs")
    with pytest.raises(RuntimeError, match="Run it as its own process"):
        example.split_cpu(2)


@pytest.mark.parametrize("name", NAMES)
def test_flags(name, capsys):
    example = load(name)
    quick = example.parse_args(["--quick"])
    default = example.parse_args([])
    assert quick.epochs < default.epochs
    assert example.parse_args(["--epochs", "7"]).epochs == 7
    with pytest.raises(SystemExit):
        example.parse_args(["--epochs", "0"])
    assert "--epochs must be >= 1" in capsys.readouterr().err
