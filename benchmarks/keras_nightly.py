"""Runs tf_als's tests on Keras's next release, and says what breaks.

`setup.cfg` caps Keras below the first release the suite has not passed on.
This script is how the cap moves: it makes a virtual environment that sees
this machine's packages (TensorFlow, keras-hub, pytest, ...), installs the
newest `keras-nightly` (or the package given) into it, so that its `keras`
hides the installed one, and runs the tests there on this checkout's code.
It prints the Keras version, the counts, and the failing tests grouped by
the error they end in. It exits 0 whatever the tests give (CI reports with
it, and does not fail on it), and 1 only where it could not run them at
all; `--strict` makes a failing test exit 1 too.

    python benchmarks/keras_nightly.py                       # tests/model
    python benchmarks/keras_nightly.py --tests tests tf_als  # the default suite
    python benchmarks/keras_nightly.py --package keras==3.16.0

Needs the package registry (the one download is Keras itself).
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import venv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tests that reach Keras's private names most (the fence, the plan,
# the instrumented model): about 2 minutes on 2 cores.
DEFAULT_TESTS = ("tests/model",)


def make_environment(where: str, package: str) -> str:
    """A virtual environment at `where` with `package` installed over the
    machine's Keras; returns its interpreter."""
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(where)
    python = os.path.join(where, "bin", "python")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--pre", "--no-deps", package],
        check=True,
    )
    return python


def keras_version(python: str) -> str:
    """The Keras version `python` imports, and where from."""
    out = subprocess.run(
        [python, "-c", "import keras; print(keras.__version__, keras.__file__)"],
        capture_output=True, text=True, check=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    return out.stdout.strip()


def run_tests(python: str, tests, workers: int) -> str:
    """pytest's output for `tests`, run on this checkout from `python`."""
    # COLUMNS: pytest cuts each summary line to the terminal's width.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT, COLUMNS="400")
    command = [python, "-m", "pytest", "-q", "-rfE", "--tb=no", "-p", "no:cacheprovider"]
    if workers > 1:
        command += ["-n", str(workers)]
    result = subprocess.run(
        command + list(tests), cwd=ROOT, env=env, capture_output=True, text=True
    )
    return result.stdout + result.stderr


_FAILED = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$")
_SUMMARY = re.compile(r"^(?:=+ )?(\d+ (?:passed|failed|error).*) in [\d.]+s")


def summarise(output: str):
    """(pytest's summary line, {error: [test ids]}) read from `output`."""
    by_error = collections.defaultdict(list)
    summary = "pytest printed no summary"
    for line in output.splitlines():
        failed = _FAILED.match(line)
        if failed:
            by_error[(failed.group(3) or "(no message)")[:160]].append(failed.group(2))
        found = _SUMMARY.match(line)
        if found:
            summary = found.group(1)
    return summary, dict(by_error)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default="keras-nightly",
                        help="the Keras to try, as pip names it (default: the newest keras-nightly)")
    parser.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS),
                        help="test paths, as pytest takes them (default: tests/model)")
    parser.add_argument("--workers", type=int, default=2,
                        help="pytest-xdist workers (default 2)")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when a test fails")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tf_als_keras_next_") as where:
        try:
            python = make_environment(where, args.package)
            version = keras_version(python)
        except subprocess.CalledProcessError as error:
            print(f"keras_nightly: could not install {args.package!r}: {error}")
            return 1
        output = run_tests(python, args.tests, args.workers)
    summary, by_error = summarise(output)
    print(f"Keras under test: {version}")
    print(f"tests: {' '.join(args.tests)}")
    print(f"result: {summary}")
    for error, tests in sorted(by_error.items(), key=lambda item: -len(item[1])):
        print(f"\n{len(tests)} ending in: {error}")
        for test in tests[:5]:
            print(f"    {test}")
        if len(tests) > 5:
            print(f"    ... and {len(tests) - 5} more")
    if not by_error and "passed" not in summary:
        print(output[-3000:])
        return 1
    return 1 if (args.strict and by_error) else 0


if __name__ == "__main__":
    sys.exit(main())
