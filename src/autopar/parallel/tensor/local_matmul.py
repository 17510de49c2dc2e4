"""Batched matmuls of DTensors split alike along their batch dimensions run on the local shards.

DTensor lowers a matmul of >2-D tensors to flatten / ``bmm`` / unflatten. When one batch dimension is split over two
mesh axes (the heads of a 4-way tensor-parallel split on autopar's 2 x 2 world mesh of 4 devices), the flatten yields
a ``_StridedShard`` that the unflatten cannot take back ("Cannot unflatten tensor with _StridedShard placement"), and
a user's ``q @ k.transpose(-2, -1)`` fails. The product of shards aligned on the batch dimensions is the shard of the
product, so computing it locally skips no communication and equals the unsharded result.

Active (a torch function mode) only while the semi-auto runtime runs a forward pass on a mesh of two or more axes.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}


def batch_aligned(a, b) -> bool:
    """Both DTensors on one mesh, same batch shape, identical placements that split only batch dimensions."""
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)) or a.device_mesh != b.device_mesh:
        return False
    if a.dim() < 3 or a.dim() != b.dim() or a.shape[:-2] != b.shape[:-2] or a.placements != b.placements:
        return False
    return all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim < a.dim() - 2) for p in a.placements)


class LocalBatchedMatmul(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and len(args) == 2 and not kwargs and batch_aligned(*args):
            a, b = args
            local = torch.matmul(a.to_local(), b.to_local())
            shape = (*a.shape[:-1], b.shape[-1])
            stride = torch.empty(shape, device="meta").stride()
            return DTensor.from_local(local, a.device_mesh, a.placements, run_check=False, shape=shape, stride=stride)
        return func(*args, **kwargs)


def enter() -> LocalBatchedMatmul:
    mode = LocalBatchedMatmul()
    mode.__enter__()
    return mode


def leave(mode: TorchFunctionMode) -> None:
    """Pop ``mode`` (this one, or context parallelism's attention) if it is the innermost one (a forward that raised may have left modes above it: leave those)."""
    stack = torch.overrides._get_current_function_mode_stack()
    if stack and stack[-1] is mode:
        mode.__exit__(None, None, None)
