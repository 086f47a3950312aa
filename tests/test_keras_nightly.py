"""`benchmarks/keras_nightly.py` reads pytest's report right: the counts,
and the failing tests grouped by the error they end in (CI prints what it
reads, so a misread report would hide what breaks on Keras's next release).
The report below has the shape `pytest -q -rfE --tb=no` prints."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import keras_nightly  # noqa: E402

REPORT = """\
..F.F..E                                                                [100%]
=========================== short test summary info ============================
FAILED tests/model/test_a.py::test_one - AttributeError: module has no attribute 'x'
FAILED tests/model/test_a.py::test_two[bert] - AttributeError: module has no attribute 'x'
FAILED tests/model/test_b.py::test_three
ERROR tests/model/test_c.py::test_four - ImportError: cannot import name 'y'
2 failed, 4 passed, 1 error, 3 warnings in 12.34s
"""


def test_the_counts_and_the_failures_by_error():
    summary, by_error = keras_nightly.summarise(REPORT)
    assert summary == "2 failed, 4 passed, 1 error, 3 warnings"
    assert by_error == {
        "AttributeError: module has no attribute 'x'": [
            "tests/model/test_a.py::test_one",
            "tests/model/test_a.py::test_two[bert]",
        ],
        "(no message)": ["tests/model/test_b.py::test_three"],
        "ImportError: cannot import name 'y'": ["tests/model/test_c.py::test_four"],
    }


def test_a_report_without_a_summary_says_so():
    summary, by_error = keras_nightly.summarise("ImportError while loading conftest\n")
    assert summary == "pytest printed no summary"
    assert by_error == {}
