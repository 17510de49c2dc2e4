"""Row sources: CIFAR-10 binary files and in-memory arrays.

A source knows how many rows it has, its column names, and how to gather an arbitrary set of rows into
``(n, ...)`` column arrays in one vectorised call. Everything else (order, sharding, shuffling, transforms,
batching) is the pipeline's job, so adding a source means implementing :class:`Source` only.

CIFAR-10 files are opened with ``np.memmap``: no load time, no per-process copy (the page cache is shared by
every rank of a data-parallel job on a host) and a batch is one fancy-indexing gather per file.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from autopar.errors import DatasetError

CIFAR10_DIRNAME = "cifar-10-batches-bin"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_TEST_FILES = ("test_batch.bin",)
CIFAR10_RECORD = 1 + 32 * 32 * 3  # label byte + CHW image
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


class Source:
    """Interface of a row source."""

    name = "source"
    column_names: list[str]
    num_rows: int

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:  # pragma: no cover
        raise NotImplementedError


def cifar10_files(usage: str) -> tuple[str, ...]:
    """File names read for ``usage`` ('train', 'test' or 'all'), in reading order."""
    if usage == "train":
        return CIFAR10_TRAIN_FILES
    if usage == "test":
        return CIFAR10_TEST_FILES
    if usage == "all":
        return CIFAR10_TRAIN_FILES + CIFAR10_TEST_FILES
    raise DatasetError(f"Cifar10Dataset: usage must be 'train', 'test' or 'all', got {usage!r}")


def resolve_cifar10_dir(dataset_dir: Any, files: tuple[str, ...]) -> Path:
    """The directory holding the ``.bin`` files: ``dataset_dir`` itself or its ``cifar-10-batches-bin``."""
    root = Path(dataset_dir).expanduser()
    if not root.is_dir():
        raise DatasetError(f"Cifar10Dataset: dataset directory {root} does not exist")
    candidates = [root, root / CIFAR10_DIRNAME]
    for cand in candidates:
        if cand.is_dir() and all((cand / f).is_file() for f in files):
            return cand
    # Report against whichever candidate has some of the files (or the root if none).
    best = max(candidates, key=lambda c: sum((c / f).is_file() for f in files) if c.is_dir() else -1)
    missing = [f for f in files if not (best / f).is_file()]
    hint = ""
    if (best / "data_batch_1").is_file() or (root / "cifar-10-batches-py").is_dir():
        hint = " (this looks like the Python-pickle version; the binary version cifar-10-binary.tar.gz is needed)"
    raise DatasetError(f"Cifar10Dataset: missing {', '.join(missing)} in {best} (expected {', '.join(files)} "
                       f"there or in {root / CIFAR10_DIRNAME}){hint}")


class Cifar10Source(Source):
    """CIFAR-10 binary records, memory-mapped. Columns: ``image`` uint8 (32, 32, 3), ``label`` uint32 scalar."""

    name = "Cifar10Dataset"
    column_names = ["image", "label"]

    def __init__(self, dataset_dir: Any, usage: str = "train"):
        files = cifar10_files(usage)
        self.directory = resolve_cifar10_dir(dataset_dir, files)
        self.paths = [self.directory / f for f in files]
        self._open()

    def _open(self) -> None:
        self._maps: list[np.ndarray] = []
        labels = []
        for path in self.paths:
            size = path.stat().st_size
            if size == 0 or size % CIFAR10_RECORD:
                raise DatasetError(f"Cifar10Dataset: {path} is truncated or corrupt: its size {size} bytes is not "
                                   f"a positive multiple of the {CIFAR10_RECORD}-byte record")
            try:
                mm = np.memmap(path, dtype=np.uint8, mode="r", shape=(size // CIFAR10_RECORD, CIFAR10_RECORD))
            except OSError as exc:
                raise DatasetError(f"Cifar10Dataset: cannot map {path}: {exc}") from None
            lab = np.array(mm[:, 0])
            bad = np.flatnonzero(lab > 9)
            if bad.size:
                raise DatasetError(f"Cifar10Dataset: {path} is corrupt: record {int(bad[0])} has label "
                                   f"{int(lab[bad[0]])} (> 9)")
            self._maps.append(mm.view(np.ndarray))
            labels.append(lab)
        self._labels = np.concatenate(labels).astype(np.uint32)
        self._starts = np.cumsum([0] + [m.shape[0] for m in self._maps])
        self.num_rows = int(self._starts[-1])

    def __getstate__(self):  # pickle paths, not mapped bytes
        return {"directory": self.directory, "paths": self.paths}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64)
        n = indices.shape[0]
        if len(self._maps) == 1:
            records = self._maps[0][indices]
        else:
            file_of = np.searchsorted(self._starts, indices, side="right") - 1
            records = np.empty((n, CIFAR10_RECORD), dtype=np.uint8)
            for f in np.unique(file_of):
                sel = file_of == f
                records[sel] = self._maps[f][indices[sel] - self._starts[f]]
        image = np.ascontiguousarray(records[:, 1:].reshape(n, 3, 32, 32).transpose(0, 2, 3, 1))
        return {"image": image, "label": self._labels[indices]}


def _as_array(value: Any, where: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except ValueError as exc:  # ragged nested lists
        raise DatasetError(f"{where}: cannot make an array of a column: {exc}") from None
    if arr.ndim == 0:
        raise DatasetError(f"{where}: a column must have a leading row axis, got a scalar {value!r}")
    return arr


class NumpySlicesSource(Source):
    """In-memory columns sliced along axis 0. ``data``: dict of arrays (keys name the columns), tuple of arrays
    (one column each) or one array / list / tensor (one column)."""

    name = "NumpySlicesDataset"

    def __init__(self, data: Any, column_names=None):
        where = self.name
        if isinstance(data, dict):
            names, cols = [str(k) for k in data], [_as_array(v, where) for v in data.values()]
        elif isinstance(data, tuple):
            names, cols = [f"column_{i}" for i in range(len(data))], [_as_array(v, where) for v in data]
        else:
            names, cols = ["column_0"], [_as_array(data, where)]
        if not cols:
            raise DatasetError(f"{where}: data has no columns")
        if column_names is not None:
            column_names = [column_names] if isinstance(column_names, str) else list(column_names)
            if len(column_names) != len(cols):
                raise DatasetError(f"{where}: {len(column_names)} column_names for {len(cols)} columns")
            names = [str(c) for c in column_names]
        if len(set(names)) != len(names):
            raise DatasetError(f"{where}: duplicate column names {names}")
        lengths = {n: c.shape[0] for n, c in zip(names, cols)}
        if len(set(lengths.values())) != 1:
            raise DatasetError(f"{where}: columns have different numbers of rows: {lengths}")
        self.column_names = names
        self._cols = cols
        self.num_rows = int(cols[0].shape[0])

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {n: c[indices] for n, c in zip(self.column_names, self._cols)}
