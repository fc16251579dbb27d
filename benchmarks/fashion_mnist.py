"""Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (60,000 + 10,000 images).

The package installs the original idx files (gzip-compressed) under
``/usr/share/datasets/fashion-mnist``; :func:`locate` finds them with ``dpkg -L`` (falling back
to that directory), :func:`ensure_installed` installs the package with ``apt-get`` when it is
missing (root needed), and :func:`load` parses the idx files directly (no torchvision, no
download at run time):

* idx header: two zero bytes, a type code (0x08 = unsigned byte), the number of dimensions d,
  then d big-endian uint32 sizes; the data follows in row-major order.
* images: ``[n, 28, 28]`` uint8 → float32 in [0, 1]; labels: ``[n]`` uint8 → int64 (10 classes).
"""

from __future__ import annotations

import functools
import gzip
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PACKAGE = "dataset-fashion-mnist"
DEFAULT_DIR = Path("/usr/share/datasets/fashion-mnist")
FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
           "Bag", "Ankle boot")
#: Per-pixel mean and standard deviation of the training images (for normalization).
MEAN, STD = 0.2860, 0.3530


@dataclass(frozen=True)
class Split:
    """Images float32 [n, 1, 28, 28] (normalized with MEAN/STD) and int64 labels [n]."""

    images: np.ndarray
    labels: np.ndarray

    def shard(self, rank: int, size: int) -> Split:
        """This rank's disjoint, equally sized part (every size-th sample; remainder dropped)."""
        n = (len(self.labels) // size) * size
        return Split(self.images[rank:n:size], self.labels[rank:n:size])


def locate() -> Path | None:
    """The directory holding the four idx files, or None when the package is not installed."""
    if shutil.which("dpkg"):
        proc = subprocess.run(["dpkg", "-L", PACKAGE], capture_output=True, text=True)
        if proc.returncode == 0:
            for line in proc.stdout.splitlines():
                if line.endswith(FILES["train_images"]):
                    return Path(line).parent
    if all((DEFAULT_DIR / f).exists() for f in FILES.values()):
        return DEFAULT_DIR
    return None


def ensure_installed() -> Path:
    """Return the data directory, installing ``dataset-fashion-mnist`` with apt-get if needed."""
    found = locate()
    if found is not None:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise RuntimeError(
            f"Fashion-MNIST is missing: install the Debian package with "
            f"`sudo apt-get install -y {PACKAGE}` (needs root and apt)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    proc = subprocess.run(["apt-get", "install", "-y", PACKAGE], env=env, capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0:  # the package lists may be stale: update once and retry
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=900)
        proc = subprocess.run(["apt-get", "install", "-y", PACKAGE], env=env,
                              capture_output=True, text=True, timeout=1800)
    found = locate()
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"apt-get install {PACKAGE} failed:\n{proc.stderr[-2000:]}")
    return found


def read_idx(path: Path) -> np.ndarray:
    """Parse one (optionally gzip-compressed) idx file of unsigned bytes."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: not an idx file")
    if data[2] != 0x08:
        raise ValueError(f"{path}: idx type 0x{data[2]:02x}, expected 0x08 (unsigned byte)")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {body.size} bytes of data for shape {shape}")
    return body.reshape(shape)


@functools.lru_cache(maxsize=2)
def load(directory: str | None = None) -> tuple[Split, Split]:
    """(train, test) splits: 60,000 and 10,000 images, normalized, as float32 [n, 1, 28, 28]."""
    folder = Path(directory) if directory else locate()
    if folder is None:
        raise RuntimeError(f"Fashion-MNIST not found; run `apt-get install -y {PACKAGE}` "
                           "(the benchmarks' setup step does it)")

    def split(images: str, labels: str) -> Split:
        x = read_idx(folder / FILES[images]).astype(np.float32) / 255.0
        y = read_idx(folder / FILES[labels]).astype(np.int64)
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"{images}: {x.shape[0]} images but {y.shape[0]} labels")
        x = ((x - MEAN) / STD).astype(np.float32)[:, None]
        return Split(x, y)

    return split("train_images", "train_labels"), split("test_images", "test_labels")
