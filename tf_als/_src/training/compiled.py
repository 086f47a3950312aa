"""Where a step traced without XLA calls a small function that XLA compiles.

Without XLA, TensorFlow dispatches each op of a step on its own (a kernel
launch each on a GPU), however small its tensor. The scalar ops of a
point's choice of its scale are one call of a compiled function
(`choice.compiled_choice`) instead of a dozen-odd ops one by one.
`wanted()` says where that holds: in a graph being traced, that XLA does
not compile already (under XLA the step fuses those ops itself), on a
device where XLA runs.

>>> wanted()  # Eagerly: the ops run one by one, as they come.
False
"""

import functools

import tensorflow as tf

from tf_als._src.model import _keras


def wanted() -> bool:
    """Whether the ops made now belong in a compiled function: a graph is
    being traced, XLA does not compile it, and XLA runs on this machine's
    default device (`xla_runs`)."""
    return (
        not tf.executing_eagerly()
        and not _keras.compiled_by_xla()
        and xla_runs()
    )


@functools.cache
def xla_runs() -> bool:
    """Whether a function compiled by XLA runs on the default device, found
    once per process by running one (`_probe`). Not every device has XLA:
    Keras, for one, does not compile its step on an Apple GPU under
    tensorflow-metal. Where it does not, the same ops run one by one and
    compute the same values."""
    return _probe()


def _probe() -> bool:
    """Runs a two-element float16 sum compiled by XLA, eagerly on the
    default device: True if it ran, False if TensorFlow could not run it."""
    with tf.init_scope():
        try:
            tf.function(lambda x: x + x, jit_compile=True)(tf.ones([2], tf.float16))
        except tf.errors.OpError:
            return False
    return True
