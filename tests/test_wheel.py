"""A package people can depend on: the wheel built from the repository
installs into a fresh virtualenv, outside the checkout, and runs the demo.

The virtualenv sees the machine's site-packages (`--system-site-packages`)
for TensorFlow, Keras and the rest, which it could otherwise only download;
tf_als itself comes from the wheel alone (`--no-deps --no-index`), and the
test checks that the interpreter imports it from the virtualenv, not from
the checkout or its editable install. The wheel is built without build
isolation, with the setuptools installed here: no network.
"""

import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 900


def _run(command, cwd, env=None):
    result = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 0, (
        f"{' '.join(command)} failed ({result.returncode}):\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout


@pytest.mark.slow  # ~1 min: a build, a virtualenv and the demo's quick failure part
def test_the_wheel_installs_outside_the_checkout_and_runs_the_demo(tmp_path):
    # A copy of the repository's files, so that the build's `build/` and
    # `*.egg-info` directories land in the copy, not in the checkout.
    source = tmp_path / "source"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, name), target)
    wheels = tmp_path / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps",
         "--no-build-isolation", "-w", str(wheels)],
        cwd=str(tmp_path),
    )
    (wheel,) = glob.glob(str(wheels / "tf_als-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    # The whole package, and nothing of the repository around it.
    for module in ("tf_als/__init__.py", "tf_als/demo.py", "tf_als/_src/scaling/rule.py",
                   "tf_als/_src/training/optimizer.py", "tf_als/_src/demo/demo.py"):
        assert module in names, module
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "examples/"))]
    assert any(n.endswith("/LICENSE") or n.endswith("LICENSE") for n in names), names

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
         cwd=str(tmp_path))
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", wheel],
         cwd=str(tmp_path))

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    where = _run([python, "-c", "import tf_als; print(tf_als.__file__, tf_als.__version__)"],
                 cwd=str(elsewhere), env=env)
    location, version = where.split()
    assert location.startswith(str(venv)), location
    assert not location.startswith(ROOT), location

    out = elsewhere / "run"
    # The demo's smaller part (tests/test_demo.py runs both, in process).
    printed = _run([python, "-m", "tf_als.demo", "--quick", "--parts", "failure",
                    "--output-dir", str(out)], cwd=str(elsewhere), env=env)
    assert (out / "results.md").exists(), printed
    with open(out / "results.md") as handle:
        header = handle.readline().strip()
    # The installed demo printed its table (the demo's own tests check
    # what the table says).
    assert header.startswith("| run |") and header in printed, printed
