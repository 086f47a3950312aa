"""The training data `fit` was given, read again for tf_als's checks: its
shapes and dtypes (to build the optimizer and metrics before the first
trace), and its batches (for the first-batch check and the guard's eager
re-run)."""

import keras
import tensorflow as tf
from keras import tree


def batch_spec(x, y, sample_weight):
    """`(x, y, sample_weight)` with the shapes and dtypes of the training
    data (arrays or tensors, or a `tf.data.Dataset`'s `tf.TensorSpec`s), or
    None when they are not known without reading it (generators, Keras
    `PyDataset`s, ragged or sparse elements)."""
    if isinstance(x, tf.data.Dataset):
        spec = x.element_spec
        if not all(isinstance(s, tf.TensorSpec) for s in tree.flatten(spec)):
            return None
        return spec if isinstance(spec, tuple) else (spec,)
    leaves = [a for a in tree.flatten((x, y, sample_weight)) if a is not None]
    if x is None or not all(
        hasattr(a, "shape") and hasattr(a, "dtype") for a in leaves
    ):
        return None
    return (x, y, sample_weight)


def batches(x, y, sample_weight, batch_size):
    """A callable giving `(x, y, sample_weight)` batches of the training
    data (arrays, tensors or structures of them, or a `tf.data.Dataset`) for
    the guard's eager re-run; None for other inputs (generators, Keras
    `PyDataset`s), which cannot be read twice."""
    if isinstance(x, tf.data.Dataset):
        return lambda: (
            keras.utils.unpack_x_y_sample_weight(e if isinstance(e, tuple) else (e,))
            for e in x
        )
    leaves = tree.flatten(x) if x is not None else []
    if not leaves or not all(hasattr(a, "shape") and len(a.shape) for a in leaves):
        return None
    size = int(leaves[0].shape[0])
    step = int(batch_size or 32)

    def cut(structure, i):
        if structure is None:
            return None
        return tree.map_structure(lambda a: a[i : i + step], structure)

    return lambda: (
        (cut(x, i), cut(y, i), cut(sample_weight, i)) for i in range(0, size, step)
    )
