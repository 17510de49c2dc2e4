"""``GeneratorDataset``: rows from a Python object, in the same vectorised pipeline as the file sources.

``source`` is, as in MindSpore, either

* random-accessible -- ``source[i]`` and ``len(source)``: rows are fetched when a batch needs them; shuffled by
  default (``shuffle=None``), sharded by ``num_shards``/``shard_id`` like every source here; or
* iterable -- a generator function (called once), a generator, or any iterable: it is read once, whole, into memory
  when the dataset is built, then served in order (``shuffle=None`` means no shuffle; ``shuffle=True`` is an error,
  as in MindSpore). Sharding such a source works here (MindSpore refuses a sampler on one): the rows are known.

A row is a tuple with one value per column (numpy arrays, numbers, torch tensors) or one value for one column;
``column_names`` names the columns (``column_0``, ``column_1`` ... when not given).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from autopar.dataset.pipeline import Dataset
from autopar.dataset.sampler import ShardSampler, no_custom_sampler
from autopar.dataset.sources import Source
from autopar.errors import DatasetError

WHERE = "GeneratorDataset"


def _as_row(item: Any, columns: int | None) -> tuple:
    row = tuple(item) if isinstance(item, (tuple, list)) else (item,)
    row = tuple(v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for v in row)
    if columns is not None and len(row) != columns:
        raise DatasetError(f"{WHERE}: a row has {len(row)} value(s) but there are {columns} column(s)")
    return row


def _stack(values: list) -> Any:
    if all(v.shape == values[0].shape for v in values):
        return np.stack(values)
    return values  # ragged: the pipeline keeps rows of different shapes as a list


def random_access(source: Any) -> bool:
    return hasattr(source, "__getitem__") and hasattr(source, "__len__")


class GeneratorSource(Source):
    name = WHERE

    def __init__(self, source: Any, column_names: Any = None):
        names = [column_names] if isinstance(column_names, str) else (list(column_names) if column_names else None)
        self._random = random_access(source)
        if self._random:
            self._source = source
            self.num_rows = len(source)
            if self.num_rows < 1:
                raise DatasetError(f"{WHERE}: the source is empty")
            width = len(_as_row(source[0], None))
        else:
            iterator = source() if callable(source) and not hasattr(source, "__iter__") else source
            try:
                rows = [_as_row(item, len(names) if names else None) for item in iterator]
            except TypeError as exc:
                raise DatasetError(f"{WHERE}: the source must be random-accessible (__getitem__ and __len__), "
                                   f"iterable, or a generator function: {exc}") from None
            if not rows:
                raise DatasetError(f"{WHERE}: the source produced no rows")
            width = len(rows[0])
            if any(len(r) != width for r in rows):
                raise DatasetError(f"{WHERE}: the source's rows have different numbers of values")
            self._columns = [_stack([r[c] for r in rows]) for c in range(width)]
            self.num_rows = len(rows)
        if names is not None and len(names) != width:
            raise DatasetError(f"{WHERE}: {len(names)} column_names {names} for rows of {width} value(s)")
        self.column_names = names or [f"column_{i}" for i in range(width)]

    def gather(self, indices: np.ndarray) -> dict[str, Any]:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if self._random:
            rows = [_as_row(self._source[int(i)], len(self.column_names)) for i in indices]
            return {n: _stack([r[c] for r in rows]) if rows else np.empty(0)
                    for c, n in enumerate(self.column_names)}
        return {n: (col[indices] if isinstance(col, np.ndarray) else [col[int(i)] for i in indices])
                for n, col in zip(self.column_names, self._columns)}


class GeneratorDataset(Dataset):
    """``GeneratorDataset(source, column_names=None, column_types=None, schema=None, num_samples=None,
    num_parallel_workers=1, shuffle=None, sampler=None, num_shards=None, shard_id=None,
    python_multiprocessing=True, max_rowsize=None)``; see the module docstring. ``column_types`` casts the
    columns; the worker options are accepted and ignored (rows are gathered in the pipeline's producer thread)."""

    def __init__(self, source, column_names=None, column_types=None, schema=None, num_samples=None,
                 num_parallel_workers=1, shuffle=None, sampler=None, num_shards=None, shard_id=None,
                 python_multiprocessing=True, max_rowsize=None, **kwargs):
        no_custom_sampler(sampler, WHERE)
        if schema is not None:
            raise DatasetError(f"{WHERE}: schema is not supported; give column_names (and column_types)")
        if shuffle and not random_access(source):
            raise DatasetError(f"{WHERE}: shuffle=True needs a random-accessible source (__getitem__ and __len__); "
                               f"shuffle the data afterwards with .shuffle(buffer_size)")
        if shuffle is None and not random_access(source):
            shuffle = False
        shard_sampler = ShardSampler(shuffle, num_shards, shard_id, num_samples, where=WHERE)
        src = GeneratorSource(source, column_names)
        self._init_pipeline(src, shard_sampler.bind(src.num_rows))
        if column_types is not None:
            from autopar.dataset.transforms import TypeCast

            if len(column_types) != len(src.column_names):
                raise DatasetError(f"{WHERE}: {len(column_types)} column_types for {len(src.column_names)} columns")
            casted = self
            for name, dtype in zip(src.column_names, column_types):
                casted = casted.map(TypeCast(dtype), input_columns=name)
            self.__dict__.update(casted.__dict__)
