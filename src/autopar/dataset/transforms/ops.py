"""Generic transforms (``TypeCast``, ``Compose``) and the :class:`Transform` base of every autopar transform.

Why a base class: the pipeline must tell *our* transforms (vectorised, run on a whole ``(N, ...)`` batch in
one numpy/torch call, randomness drawn from an explicit Generator) from arbitrary user callables (run per row,
slow path). ``Transform.apply_batch(batch, rng)`` is the fast path; ``Transform.__call__(x)`` is the
user-facing convenience that accepts one sample or a batch, numpy or torch.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from autopar.errors import DatasetError


class Transform:
    """Base class: subclasses implement :meth:`apply_batch` on a batch whose axis 0 is the sample axis.

    ``image_op`` transforms look at the trailing image axes: a single sample is ``(H, W)`` or ``(H, W, C)``
    and a batch is ``(N, H, W)`` or ``(N, H, W, C)``; ``__call__`` treats a 4-D input as a batch and anything
    smaller as one image. Element-wise transforms (``image_op = False``) see the input as it is.
    """

    image_op = False
    random = False

    def apply_batch(self, batch: np.ndarray, rng: np.random.Generator) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    def __call__(self, x: Any, rng: np.random.Generator | None = None):
        from autopar.dataset._random import eager_rng

        rng = eager_rng() if rng is None else rng
        is_torch = isinstance(x, torch.Tensor)
        arr = x.detach().cpu().numpy() if is_torch else np.asarray(x)
        if self.image_op and arr.ndim < 4:
            if arr.ndim < 2:
                raise DatasetError(f"{type(self).__name__}: expected an image (H, W[, C]) or a batch (N, H, W, C), "
                                   f"got shape {arr.shape}")
            out = self.apply_batch(arr[None], rng)[0]
        else:
            out = self.apply_batch(arr, rng)
        if is_torch:
            return torch.from_numpy(np.ascontiguousarray(out))
        return out

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


_TORCH_TO_NUMPY = {
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _TORCH_TO_NUMPY[getattr(torch, _name)] = getattr(np, _name)


def to_numpy_dtype(dtype: Any, where: str = "TypeCast") -> np.dtype:
    """Resolve a torch dtype, numpy dtype, Python type or string ('int32', 'float32', 'mstype.int32')."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_TO_NUMPY:
            raise DatasetError(f"{where}: data type {dtype} has no numpy equivalent")
        return np.dtype(_TORCH_TO_NUMPY[dtype])
    if isinstance(dtype, str):
        dtype = dtype.rsplit(".", 1)[-1]  # "mstype.int32", "torch.int32" -> "int32"
    try:
        return np.dtype(dtype)
    except TypeError as exc:
        raise DatasetError(f"{where}: unsupported data type {dtype!r} ({exc})") from None


class TypeCast(Transform):
    """Cast to ``dtype`` (torch dtype such as ``autopar.int32``, numpy dtype or string)."""

    def __init__(self, data_type: Any):
        self.data_type = to_numpy_dtype(data_type)

    def apply_batch(self, batch, rng=None):
        return np.asarray(batch).astype(self.data_type, copy=False)


class Compose(Transform):
    """Apply ``transforms`` in order. Inside ``map`` it is flattened into the operation list, so our
    transforms keep their vectorised path and user callables keep their per-row semantics."""

    def __init__(self, transforms: Sequence[Any]):
        if callable(transforms) and not isinstance(transforms, (list, tuple)):
            transforms = [transforms]
        transforms = list(transforms)
        if not transforms:
            raise DatasetError("Compose: the list of transforms is empty")
        for op in transforms:
            if not callable(op):
                raise DatasetError(f"Compose: {op!r} is not callable")
        self.transforms = transforms
        self.random = any(getattr(op, "random", True) for op in transforms)

    def flatten(self) -> list:
        out: list = []
        for op in self.transforms:
            out.extend(op.flatten() if isinstance(op, Compose) else [op])
        return out

    def apply_batch(self, batch, rng):
        for op in self.flatten():
            if isinstance(op, Transform):
                batch = op.apply_batch(batch, rng)
            else:
                batch = np.stack([np.asarray(op(row)) for row in batch])
        return batch

    def __call__(self, x, rng=None):
        for op in self.transforms:
            x = op(x, rng) if isinstance(op, Transform) else op(x)
        return x
