"""TensorFlow's known-harmless native log lines, held back from the demo's
output.

TensorFlow's C++ code writes to file descriptor 2 directly, so Python's
`sys.stderr` cannot filter it; `TF_CPP_MIN_LOG_LEVEL` is read once, when
TensorFlow logs its first line (at import, before the demo runs under
`python -m tf_als.demo`). `filtered_stderr` routes descriptor 2 through a
pipe for the duration of a block and forwards every line except INFO lines
and those that match `HARMLESS` exactly, so real errors and warnings still
show.
"""

import contextlib
import os
import re
import sys
import threading

# (substring, substring): a line containing both is dropped.
HARMLESS = (
    # TensorFlow 2.21, CPU-only machine: the CUDA platform probes for a
    # driver and logs the failure as an error; training goes on on the CPU.
    ("cuda_platform.cc", "failed call to cuInit"),
    # TensorFlow 2.21's grappler, on the `tf.cond` of Keras's (and tf_als's)
    # loss-scale update: a skipped graph optimisation, not a fault.
    ("loop_optimizer.cc", "Skipping loop optimization for Merge node"),
)


def harmless(line: str) -> bool:
    """Whether `line` is one of `HARMLESS`, or an INFO line of TensorFlow's
    native log (`I0000 00:00:...`; `TF_CPP_MIN_LOG_LEVEL=2` hides those
    too, when it is set before TensorFlow is imported).

    Example:

    ```python
    harmless("E0000 ... cuda_platform.cc:52] failed call to cuInit: ...")  # True
    harmless("E0000 ... some_kernel.cc:10] Out of memory")               # False
    harmless("I0000 00:00:17.5 1 service.cc:153] XLA service ...")      # True
    ```
    """
    if re.match(r"I\d{4} \d\d:\d\d:", line):
        return True
    return any(all(part in line for part in parts) for parts in HARMLESS)


@contextlib.contextmanager
def filtered_stderr():
    """Within the block, lines written to descriptor 2 (by Python or by
    native code) reach the real stderr unless `harmless`. A no-op where
    descriptor 2 cannot be duplicated."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    read_end, write_end = os.pipe()
    forward = threading.Thread(target=_forward, args=(read_end, saved), daemon=True)
    forward.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # Closes the pipe's last write end: _forward ends.
        forward.join(timeout=5)
        os.close(saved)


def _forward(read_end, target):
    with os.fdopen(read_end, "rb") as pipe:
        for line in pipe:
            if not harmless(line.decode("utf-8", "replace")):
                os.write(target, line)
