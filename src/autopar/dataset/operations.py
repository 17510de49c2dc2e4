"""A pipeline's operations as values (map, shuffle, batch, repeat, project, take), their argument checks, and how a
map applies to a batch of columns -- what :class:`~autopar.dataset.pipeline.Dataset` chains."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from autopar.dataset.transforms.ops import Transform
from autopar.errors import DatasetError


@dataclass(frozen=True)
class _Map:
    operations: tuple
    input_columns: tuple
    output_columns: tuple


@dataclass(frozen=True)
class _Shuffle:
    buffer_size: int


@dataclass(frozen=True)
class _Batch:
    batch_size: int
    drop_remainder: bool


@dataclass(frozen=True)
class _Repeat:
    count: int | None  # None: forever


@dataclass(frozen=True)
class _Project:
    columns: tuple


@dataclass(frozen=True)
class _Take:
    count: int


def _column_list(value, what: str, where: str) -> list[str]:
    cols = [value] if isinstance(value, str) else list(value)
    if not cols or not all(isinstance(c, str) for c in cols):
        raise DatasetError(f"{where}: {what} must be a column name or a non-empty list of names, got {value!r}")
    if len(set(cols)) != len(cols):
        raise DatasetError(f"{where}: {what} has duplicates: {cols}")
    return cols


def _check_known(cols: Sequence[str], known: Sequence[str], where: str) -> None:
    unknown = [c for c in cols if c not in known]
    if unknown:
        raise DatasetError(f"{where}: unknown column(s) {unknown}; the dataset has {list(known)}")


def _positive_int(value, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise DatasetError(f"{where}: {name} must be a positive integer, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------------------------- data execution
def _stack(items: list):
    """Stack per-row results into one array; rows of different shapes stay a list (ragged column)."""
    arrs = [np.asarray(a) for a in items]
    if all(a.shape == arrs[0].shape for a in arrs):
        return np.stack(arrs)
    return arrs


def _as_tuple(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _apply_map(op: _Map, cols: dict, rng: np.random.Generator, per_row: bool) -> dict:
    vals = [cols[c] for c in op.input_columns]
    for fn in op.operations:
        name = getattr(fn, "__name__", type(fn).__name__)
        if isinstance(fn, Transform):
            if len(vals) != 1:
                raise DatasetError(f"map: {name} takes one column but receives {len(vals)}")
            v = vals[0]
            if isinstance(v, list):  # ragged rows: one call per row
                vals = [_stack([fn.apply_batch(np.asarray(r)[None], rng)[0] for r in v])]
            else:
                vals = [fn.apply_batch(v, rng)]
        elif per_row:
            n = len(vals[0])
            try:
                outs = [_as_tuple(fn(*[np.asarray(v[i]) for v in vals])) for i in range(n)]
            except DatasetError:
                raise
            except Exception as exc:
                raise DatasetError(f"map: operation {name} failed on column(s) {list(op.input_columns)}: "
                                   f"{type(exc).__name__}: {exc}") from exc
            k = len(outs[0])
            if any(len(o) != k for o in outs):
                raise DatasetError(f"map: operation {name} returned different numbers of columns for different rows")
            vals = [_stack([o[j] for o in outs]) for j in range(k)]
        else:
            try:
                vals = [np.asarray(v) for v in _as_tuple(fn(*vals))]
            except DatasetError:
                raise
            except Exception as exc:
                raise DatasetError(f"map: operation {name} failed on batched column(s) {list(op.input_columns)}: "
                                   f"{type(exc).__name__}: {exc}") from exc
    if len(vals) != len(op.output_columns):
        raise DatasetError(f"map: the operations produced {len(vals)} column(s) but output_columns names "
                           f"{len(op.output_columns)}: {list(op.output_columns)}")
    out = {}
    for name, v in cols.items():
        if name == op.input_columns[0]:
            out.update(zip(op.output_columns, vals))
        elif name not in op.input_columns:
            out[name] = v
    return out


def _numpy_to_torch_dtype(dtype: np.dtype):
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except TypeError:
        return dtype


def job_device() -> torch.device | None:
    """The GPU of this rank when the job runs on GPUs (NCCL), else None: a dataset feeds the device there, as
    MindSpore's does -- its scripts never move a batch (``logits = net(data)`` with the network on the GPU)."""
    from autopar.comm import management

    if management.is_initialized() and management.device().type != "cpu":
        return management.device()
    return None


def _to_output(value, output_numpy: bool, copy: bool, device: torch.device | None = None):
    if isinstance(value, list):  # ragged column of one row can't happen; a batch can't be ragged
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        value = np.asarray(value)
    if output_numpy or value.dtype.kind in "USOV":
        return value.copy() if copy else value
    if copy or not value.flags.c_contiguous or not value.flags.writeable:
        value = value.copy()
    tensor = torch.from_numpy(value)
    return tensor if device is None else tensor.to(device)


# ------------------------------------------------------------------------------------------------------- Dataset
