"""``import mindspore.ops.functional as F`` path, and MindSpore 2.x's function-style operators (``ops.matmul``,
``ops.relu``, ``ops.reshape`` ...): plain torch functions, so they run on tensors and DTensors alike (in
SEMI_AUTO_PARALLEL a function carries its input's layout; give an operator class a strategy to choose one)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as _F

from autopar.ops.composite import depend, partial  # noqa: F401
from autopar.ops.math import scalar_to_array, scalar_to_tensor  # noqa: F401
from autopar.ops.math import shape as _shape_of


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


def relu(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x)


def reshape(x: torch.Tensor, shape: Any) -> torch.Tensor:
    return torch.reshape(x, tuple(shape))


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype)


def dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype


def fill(type: torch.dtype, shape: Any, value: Any) -> torch.Tensor:  # noqa: A002 - MindSpore's argument name
    return torch.full(tuple(shape), value, dtype=type)


def ones_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.ones_like(x, dtype=dtype)


def zeros_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.zeros_like(x, dtype=dtype)


def bias_add(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x + bias.reshape([1, -1] + [1] * (x.dim() - 2))


def assign(variable: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return variable.copy_(value)


def assign_add(variable: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return variable.add_(value)


def flatten(x: torch.Tensor, order: str = "C", *, start_dim: int = 1, end_dim: int = -1) -> torch.Tensor:
    return torch.flatten(x, start_dim, end_dim)


def expand_dims(x: torch.Tensor, axis: int) -> torch.Tensor:
    return x.unsqueeze(axis)


def concat(tensors: Any, axis: int = 0) -> torch.Tensor:
    return torch.cat(tuple(tensors), axis)


def softmax(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    return torch.softmax(x, axis)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return _F.gelu(x, approximate=approximate)


def square(x: torch.Tensor) -> torch.Tensor:
    return torch.square(x)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(x)


def exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x)


def log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x)


def ones(shape: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.ones(tuple(shape) if not isinstance(shape, int) else (shape,), dtype=dtype or torch.float32)


def zeros(shape: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.zeros(tuple(shape) if not isinstance(shape, int) else (shape,), dtype=dtype or torch.float32)


shape = _shape_of  # F.shape(x): the shape as a tuple
