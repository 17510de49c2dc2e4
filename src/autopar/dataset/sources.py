"""Row sources: CIFAR-10 binary files and in-memory arrays.

A source knows how many rows it has, its column names, and how to gather an arbitrary set of rows into
``(n, ...)`` column arrays in one vectorised call. Everything else (order, sharding, shuffling, transforms,
batching) is the pipeline's job, so adding a source means implementing :class:`Source` only.

CIFAR-10 files are read with positioned reads (``os.preadv`` straight into the batch array, one read per run of
consecutive records): no load time and no per-process copy -- the page cache is shared by every rank of a
data-parallel job on a host. Not a memory map: the kernel maps whole page-cache folios on a fault (measured: 32
scattered records mapped 47 MB), and the label scan touched every page, so each rank's resident set held the whole
dataset (154 MB for the training files).
"""
from __future__ import annotations

import os
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


def cifar10_present(dataset_dir: Any) -> tuple[str, ...]:
    """MindSpore's ``usage=None`` / ``"all"``: the training files and the test file, each group read when it is in
    the directory. A group only partly there is an error (resolve_cifar10_dir names the missing files), so a broken
    download is never read as half a dataset; no group at all is the same error."""
    root = Path(dataset_dir).expanduser()
    for cand in (root, root / CIFAR10_DIRNAME):
        found = [group for group in (CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILES)
                 if any((cand / f).is_file() for f in group)]
        if found:
            return tuple(f for group in found for f in group)
    return CIFAR10_TRAIN_FILES + CIFAR10_TEST_FILES


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
    """CIFAR-10 binary records. Columns: ``image`` uint8 (32, 32, 3), ``label`` uint32 scalar."""

    name = "Cifar10Dataset"
    column_names = ["image", "label"]
    _LABEL_CHUNK = 1024  # records per read while scanning the labels (3 MB)

    def __init__(self, dataset_dir: Any, usage: str = "train"):
        files = cifar10_present(dataset_dir) if usage == "all" else cifar10_files(usage)
        self.directory = resolve_cifar10_dir(dataset_dir, files)
        self.paths = [self.directory / f for f in files]
        self._open()

    def _open(self) -> None:
        self._fds: list[int] = []
        labels = []
        try:
            for path in self.paths:
                size = path.stat().st_size
                if size == 0 or size % CIFAR10_RECORD:
                    raise DatasetError(f"Cifar10Dataset: {path} is truncated or corrupt: its size {size} bytes is "
                                       f"not a positive multiple of the {CIFAR10_RECORD}-byte record")
                try:
                    self._fds.append(os.open(path, os.O_RDONLY))
                    lab = self._scan_labels(len(self._fds) - 1, size // CIFAR10_RECORD)
                except OSError as exc:
                    raise DatasetError(f"Cifar10Dataset: cannot read {path}: {exc}") from None
                bad = np.flatnonzero(lab > 9)
                if bad.size:
                    raise DatasetError(f"Cifar10Dataset: {path} is corrupt: record {int(bad[0])} has label "
                                       f"{int(lab[bad[0]])} (> 9)")
                labels.append(lab)
        except DatasetError:
            self.close()
            raise
        self._labels = np.concatenate(labels).astype(np.uint32)
        self._starts = np.cumsum([0] + [lab.shape[0] for lab in labels])
        self.num_rows = int(self._starts[-1])

    def _scan_labels(self, file: int, rows: int) -> np.ndarray:
        labels = np.empty(rows, dtype=np.uint8)
        chunk = np.empty((min(rows, self._LABEL_CHUNK), CIFAR10_RECORD), dtype=np.uint8)
        for start in range(0, rows, self._LABEL_CHUNK):
            part = chunk[: min(self._LABEL_CHUNK, rows - start)]
            self._read(file, memoryview(part).cast("B"), start)
            labels[start:start + part.shape[0]] = part[:, 0]
        return labels

    def _read(self, file: int, out: memoryview, record: int) -> None:
        """Fill ``out`` with whole records from ``record`` on; a file that shrank since it was opened is an error,
        never a short batch."""
        if os.preadv(self._fds[file], [out], record * CIFAR10_RECORD) != len(out):
            raise DatasetError(f"Cifar10Dataset: {self.paths[file]} was truncated while reading (record {record})")

    def close(self) -> None:
        for fd in getattr(self, "_fds", []):
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []

    def __del__(self):
        self.close()

    def __getstate__(self):  # pickle paths, not descriptors
        return {"directory": self.directory, "paths": self.paths}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = indices.shape[0]
        if n == 0:
            return {"image": np.empty((0, 32, 32, 3), dtype=np.uint8), "label": np.empty(0, dtype=np.uint32)}
        if indices.min() < 0 or indices.max() >= self.num_rows:
            raise IndexError(f"Cifar10Dataset: record index outside 0..{self.num_rows - 1}")
        # read in file order, one read per run of consecutive records, then put the rows in the order asked for
        order = np.argsort(indices, kind="stable")
        wanted = indices[order]
        file_of = np.searchsorted(self._starts, wanted, side="right") - 1
        firsts = np.flatnonzero((np.diff(wanted, prepend=-2) != 1) | (np.diff(file_of, prepend=-1) != 0))
        ends = np.append(firsts[1:], n)
        in_file_order = np.empty((n, CIFAR10_RECORD), dtype=np.uint8)
        flat = memoryview(in_file_order).cast("B")
        files = file_of[firsts]
        records_in_file = wanted[firsts] - self._starts[files]
        for a, b, f, r in zip(firsts.tolist(), ends.tolist(), files.tolist(), records_in_file.tolist()):
            self._read(f, flat[a * CIFAR10_RECORD:b * CIFAR10_RECORD], r)
        records = np.empty_like(in_file_order)
        records[order] = in_file_order
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
