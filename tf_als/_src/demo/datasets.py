"""Datasets for the demo: scikit-learn's digits (ships with scikit-learn, no
download), MNIST from a local copy of Keras's `mnist.npz`, and `prices`, a
small synthetic regression whose targets float16 cannot hold.

Nothing here touches the network: MNIST is read from a file you provide
(`keras.datasets.mnist.load_data()` on a connected machine saves it as
`~/.keras/datasets/mnist.npz`).
"""

import dataclasses
import os

import numpy as np

DATASETS = ("digits", "mnist")


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Train and test splits.

    Attributes:
        name: the dataset's name.
        x_train, y_train, x_test, y_test: numpy arrays of float32 features
            (images in [0, 1], keeping their 2-D shape with a channel axis,
            (n, height, width, 1)) and int64 labels, or float32 targets of
            shape (n, 1) for a regression.
        classes: number of classes; 0 for a regression.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: int


def load(name: str, path: str = None, test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """Loads a dataset by name.

    Args:
        name: `"digits"` (8x8 images, 1797 samples, from scikit-learn) or
            `"mnist"` (28x28, from a local `mnist.npz`).
        path: for MNIST, the `mnist.npz` file (default
            `~/.keras/datasets/mnist.npz`); unused for digits.
        test_fraction: float in (0, 1), the held-out share of digits
            (MNIST has its own split).
        seed: int, the digits split's shuffle.

    Raises:
        ValueError: unknown name or bad fraction.
        FileNotFoundError: MNIST file missing (says how to get it).
    """
    if name not in DATASETS:
        raise ValueError(
            f"`name` must be one of {', '.join(DATASETS)}; received {name!r}."
        )
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(
            f"`test_fraction` must be in (0, 1); received {test_fraction!r}."
        )
    if name == "digits":
        return _digits(test_fraction, seed)
    return _mnist(path)


def _digits(test_fraction, seed):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int64")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(round(len(x) * (1.0 - test_fraction)))
    return Dataset("digits", x[:split], y[:split], x[split:], y[split:], 10)


def _mnist(path):
    path = path or os.path.join(os.path.expanduser("~"), ".keras", "datasets", "mnist.npz")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"No MNIST file at {path!r}. tf_als never downloads at run time: "
            "on a machine with network access run "
            "`keras.datasets.mnist.load_data()` (it saves "
            "~/.keras/datasets/mnist.npz) and copy that file here, or pass "
            "its path."
        )
    with np.load(path) as data:
        missing = {"x_train", "y_train", "x_test", "y_test"} - set(data.files)
        if missing:
            raise ValueError(
                f"{path!r} is not Keras's mnist.npz: it lacks {sorted(missing)}."
            )

        def images(key):
            return (data[key] / 255.0).astype("float32")[..., None]

        return Dataset(
            "mnist",
            images("x_train"),
            data["y_train"].astype("int64"),
            images("x_test"),
            data["y_test"].astype("int64"),
            10,
        )


def prices(samples: int = 1024, test_fraction: float = 0.25, seed: int = 0) -> Dataset:
    """A synthetic house-price regression: 4 standardised features (floor
    area, rooms, age, distance to the centre) and prices in dollars, about
    110,000 to 950,000: every one above 65,504, float16's largest value.

    Args:
        samples: int >= 8, the number of houses.
        test_fraction: float in (0, 1), the held-out share.
        seed: int, the draw.

    Returns:
        A `Dataset` with `classes == 0` and targets of shape (n, 1).

    Example:

    ```python
    data = prices()
    data.x_train.shape, bool(data.y_train.min() > 65504)   # ((768, 4), True)
    ```
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 8:
        raise ValueError(f"`samples` must be an int >= 8; received {samples!r}.")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(
            f"`test_fraction` must be in (0, 1); received {test_fraction!r}."
        )
    rng = np.random.default_rng(seed)
    area = rng.uniform(40, 250, samples)
    rooms = np.clip(np.round(area / 30 + rng.normal(0, 1, samples)), 1, 9)
    age = rng.uniform(0, 80, samples)
    distance = rng.uniform(1, 30, samples)
    price = (
        250_000 + 2_500 * area + 10_000 * rooms - 1_500 * age - 5_000 * distance
        + rng.normal(0, 15_000, samples)
    )
    features = np.stack([area, rooms, age, distance], axis=1)
    x = ((features - features.mean(0)) / features.std(0)).astype("float32")
    y = price.astype("float32")[:, None]
    split = int(round(samples * (1.0 - test_fraction)))
    return Dataset("prices", x[:split], y[:split], x[split:], y[split:], 0)
