"""Whether a step's gradients are finite, and every replica skipping the
same steps.

`AdaptiveLossScaleOptimizer.apply` reads each gradient once, for its amax
(`amaxes`: a gradient is finite when its amax is, `flags_of`). The amaxes
give the points' gains (`update.write_gains`); the flags are shared three
ways: the agreement between replicas (`agree`), Keras's check
(`check_finite`, which reuses the flags computed for the very same
tensors, `flags_for`) and the record of a skipped step
(`skips.record_first_skip`).

>>> [bool(f) for f in finite_flags([tf.constant([1.0, float("inf")]), None])]
[False, True]
"""

import tensorflow as tf

from tf_als._src.scaling import rule


def all_finite(gradient) -> tf.Tensor:
    """Whether a dense or sparse (`tf.IndexedSlices`) gradient is finite.

    A sparse gradient (e.g. an `Embedding`'s) is judged by its values.
    Keras 3.15 densifies it with `tf.tensor_scatter_nd_update`, which keeps
    one row per index: when a token occurs twice in a batch and one of its
    rows is not finite, Keras's check can pass and the non-finite gradient
    is applied, leaving the embedding NaN for good (seen on a KerasHub
    Llama with dropout 0.1 under Keras's `LossScaleOptimizer`)."""
    if isinstance(gradient, tf.IndexedSlices):
        gradient = gradient.values
    return tf.reduce_all(tf.math.is_finite(gradient))


def amaxes(grads) -> list:
    """The amax of each gradient of `grads` (`rule.amaxes_of`, float32; a
    sparse gradient's values'; 0 for None): one read of each. inf or NaN
    when the gradient is not finite.

    >>> [float(a) for a in amaxes([tf.constant([1.0, -3.0]), None])]
    [3.0, 0.0]
    """
    with tf.name_scope("tf_als_check"):
        return rule.amaxes_of([
            g.values if isinstance(g, tf.IndexedSlices) else g for g in grads
        ])


def flags_of(amaxes_) -> tf.Tensor:
    """Whether each gradient is finite, from its amax (`amaxes`): a bool
    vector, one op for all of them."""
    with tf.name_scope("tf_als_check"):
        return tf.math.is_finite(_stack(amaxes_, tf.float32))


def finite_flags(grads) -> tf.Tensor:
    """Whether each gradient of `grads` is finite (True for None), as a
    bool vector."""
    return _stack(
        [tf.constant(True) if g is None else all_finite(g) for g in grads], tf.bool
    )


def all_true(flags) -> tf.Tensor:
    """Whether every flag of the bool vector `flags` is True (True for
    none)."""
    return tf.reduce_all(flags)


def _stack(values, dtype) -> tf.Tensor:
    """`values` (scalars) as a vector; an empty one of `dtype` for none."""
    return tf.stack(values) if values else tf.zeros([0], dtype)


def flags_for(grads, checked) -> tf.Tensor:
    """`finite_flags(grads)`, taken from `checked` (gradients, their flags)
    when `grads` are those very tensors."""
    if checked is not None and _same_tensors(checked[0], grads):
        return checked[1]
    return finite_flags(grads)


def agree(grads, flags) -> list:
    """`grads`, made non-finite on every replica when any replica's are.

    Keras 3.15 decides whether to apply a step from each replica's own
    gradients, before they are summed; under a `merge_call` strategy
    (MirroredStrategy) it takes the first replica's answer. When another
    replica's gradient is the non-finite one, the step is applied and the
    summed gradient writes inf into the weights (seen on the tiny KerasHub
    GPT-2 on two logical CPUs, `benchmarks/mirrored_gpt2.py`). Here the
    replicas sum one count of non-finite gradients (one scalar all-reduce
    per step), and a replica whose own gradients are finite while another's
    are not turns its smallest dense gradient into NaN, so that Keras's
    check skips the step everywhere. Nothing changes with one replica.

    Args:
        grads: list of this replica's gradients (changed in place).
        flags: `finite_flags(grads)`, a bool vector.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return grads
    dense = [
        i for i, g in enumerate(grads)
        if g is not None and not isinstance(g, tf.IndexedSlices)
    ]
    if not dense:
        return grads
    local_bad = tf.logical_not(all_true(flags))
    bad = context.all_reduce(
        tf.distribute.ReduceOp.SUM, tf.cast(local_bad, tf.float32)
    ) > 0.0
    smallest = min(dense, key=lambda i: grads[i].shape.num_elements() or 0)
    gradient = grads[smallest]
    nan = tf.fill(tf.shape(gradient), tf.constant(float("nan"), gradient.dtype))
    grads[smallest] = tf.where(bad, nan, gradient)
    return grads


def _same_tensors(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
