"""``MnistDataset``: MNIST from its idx-ubyte files, in the vectorised pipeline.

The files are the ones MindSpore reads, by name, in ``dataset_dir``: ``train-images-idx3-ubyte`` /
``train-labels-idx1-ubyte`` (usage "train", 60000 rows) and ``t10k-images-idx3-ubyte`` / ``t10k-labels-idx1-ubyte``
("test", 10000); usage None or "all" reads both, train first (MindSpore's default). The idx format: a big-endian
header (magic 2051 for images with count, rows, columns; 2049 for labels with count), then one unsigned byte per
pixel or label. Images are memory-mapped and gathered a batch at a time; columns ``image`` uint8 ``(28, 28, 1)``
(HWC, as MindSpore) and ``label`` uint32.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from autopar.dataset.pipeline import Dataset
from autopar.dataset.sampler import ShardSampler, no_custom_sampler
from autopar.dataset.sources import Source
from autopar.errors import DatasetError

MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049


def _header(path: Path, magic: int, words: int) -> tuple[int, ...]:
    try:
        with open(path, "rb") as f:
            head = np.frombuffer(f.read(4 * words), dtype=">u4")
    except OSError as exc:
        raise DatasetError(f"MnistDataset: cannot read {path}: {exc}") from None
    if head.size != words or int(head[0]) != magic:
        found = int(head[0]) if head.size else "nothing"
        raise DatasetError(f"MnistDataset: {path} is not an idx file of the expected kind (magic {found}, "
                           f"expected {magic})")
    return tuple(int(v) for v in head[1:])


def _read_pair(images: Path, labels: Path) -> tuple[np.ndarray, np.ndarray]:
    count, rows, cols = _header(images, IMAGES_MAGIC, 4)
    (nlabels,) = _header(labels, LABELS_MAGIC, 2)
    if count != nlabels:
        raise DatasetError(f"MnistDataset: {images.name} holds {count} images but {labels.name} {nlabels} labels")
    for path, size in ((images, 16 + count * rows * cols), (labels, 8 + count)):
        if os.path.getsize(path) != size:
            raise DatasetError(f"MnistDataset: {path} is truncated or corrupt: {os.path.getsize(path)} bytes, "
                               f"expected {size}")
    image = np.memmap(images, dtype=np.uint8, mode="r", offset=16, shape=(count, rows, cols, 1))
    label = np.fromfile(labels, dtype=np.uint8, offset=8).astype(np.uint32)
    if label.size and int(label.max()) > 9:
        raise DatasetError(f"MnistDataset: {labels} is corrupt: label {int(label.max())} (> 9)")
    return image, label


class MnistSource(Source):
    name = "MnistDataset"
    column_names = ["image", "label"]

    def __init__(self, dataset_dir: Any, usage: str | None = None):
        usage = "all" if usage is None else usage
        if usage not in ("train", "test", "all"):
            raise DatasetError(f"MnistDataset: usage must be 'train', 'test' or 'all', got {usage!r}")
        root = Path(dataset_dir).expanduser()
        if not root.is_dir():
            raise DatasetError(f"MnistDataset: dataset directory {root} does not exist")
        parts = ("train", "test") if usage == "all" else (usage,)
        present = [p for p in parts if all((root / f).is_file() for f in MNIST_FILES[p])]
        if not present:
            wanted = ", ".join(f for p in parts for f in MNIST_FILES[p])
            raise DatasetError(f"MnistDataset: no MNIST files for usage '{usage}' in {root} (expected {wanted}; "
                               f"gunzip the downloaded .gz files)")
        if usage != "all":
            present = parts
        pairs = [_read_pair(root / MNIST_FILES[p][0], root / MNIST_FILES[p][1]) for p in present]
        self._images = [img for img, _ in pairs]
        self._labels = np.concatenate([lab for _, lab in pairs])
        self._starts = np.cumsum([0] + [img.shape[0] for img in self._images])
        self.num_rows = int(self._starts[-1])
        self.shape = self._images[0].shape[1:]

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        image = np.empty((indices.size,) + self.shape, dtype=np.uint8)
        part = np.searchsorted(self._starts, indices, side="right") - 1
        for k, images in enumerate(self._images):
            sel = np.flatnonzero(part == k)
            if sel.size:
                image[sel] = images[indices[sel] - self._starts[k]]
        return {"image": image, "label": self._labels[indices]}


class MnistDataset(Dataset):
    """``MnistDataset(dataset_dir, usage=None, num_samples=None, num_parallel_workers=None, shuffle=None,
    sampler=None, num_shards=None, shard_id=None, cache=None)``; see the module docstring. ``shuffle=None`` means
    True; ``num_shards``/``shard_id`` shard as ``Cifar10Dataset`` does (equal shards, no communication)."""

    def __init__(self, dataset_dir, usage=None, num_samples=None, num_parallel_workers=None, shuffle=None,
                 sampler=None, num_shards=None, shard_id=None, cache=None):
        no_custom_sampler(sampler, "MnistDataset")
        shard_sampler = ShardSampler(shuffle, num_shards, shard_id, num_samples, where="MnistDataset")
        source = MnistSource(dataset_dir, usage)
        self._init_pipeline(source, shard_sampler.bind(source.num_rows))


def write_mnist(out_dir: Any, images: np.ndarray, labels: np.ndarray, usage: str = "train") -> Path:
    """Write ``images`` (n, rows, cols) uint8 and ``labels`` (n,) as the idx-ubyte pair of ``usage``."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    images = np.ascontiguousarray(images, dtype=np.uint8)
    labels = np.ascontiguousarray(labels, dtype=np.uint8)
    n, rows, cols = images.shape
    img_name, lab_name = MNIST_FILES[usage]
    (out / img_name).write_bytes(np.array([IMAGES_MAGIC, n, rows, cols], dtype=">u4").tobytes() + images.tobytes())
    (out / lab_name).write_bytes(np.array([LABELS_MAGIC, n], dtype=">u4").tobytes() + labels.tobytes())
    return out


def write_synthetic_mnist(out_dir: Any, train: int = 256, test: int = 64, seed: int = 0) -> Path:
    """A learnable MNIST-shaped set in the real file format: each class a fixed random 28x28 pattern plus noise."""
    rng = np.random.default_rng(seed)
    patterns = rng.integers(0, 256, size=(10, 28, 28))
    for usage, n in (("train", train), ("test", test)):
        if n:
            labels = rng.integers(0, 10, size=n)
            noise = rng.integers(-60, 61, size=(n, 28, 28))
            write_mnist(out_dir, np.clip(patterns[labels] + noise, 0, 255), labels, usage)
    return Path(out_dir)
