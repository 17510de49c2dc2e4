"""Communication operators for use inside a network's ``construct`` (MindSpore's ``ops.AllReduce`` etc.).

Thin callables over :mod:`autopar.comm.functional`, which carries the autograd rules.
"""
from __future__ import annotations

import torch

from autopar.comm import functional as F
from autopar.comm.functional import ReduceOp
from autopar.ops.primitive import Primitive


class _CommPrimitive(Primitive):
    """Communication ops are never re-sharded by the parallel layer: they run as written."""

    def forward(self, *args, **kwargs):
        return self.compute(*args, **kwargs)


class AllReduce(_CommPrimitive):
    def __init__(self, op: str | ReduceOp = ReduceOp.SUM, group: str | None = None):
        super().__init__()
        self.op = ReduceOp.parse(op)
        self.group = group

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return F.all_reduce(x, self.op, self.group)


class AllGather(_CommPrimitive):
    def __init__(self, group: str | None = None):
        super().__init__()
        self.group = group

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return F.all_gather(x, self.group)


class ReduceScatter(_CommPrimitive):
    def __init__(self, op: str | ReduceOp = ReduceOp.SUM, group: str | None = None):
        super().__init__()
        self.op = ReduceOp.parse(op)
        self.group = group

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return F.reduce_scatter(x, self.op, self.group)


class Broadcast(_CommPrimitive):
    """MindSpore's Broadcast takes and returns a tuple of tensors."""

    def __init__(self, root_rank: int = 0, group: str | None = None):
        super().__init__()
        self.root_rank = root_rank
        self.group = group

    def compute(self, x):
        if isinstance(x, (tuple, list)):
            return tuple(F.broadcast(t, self.root_rank, self.group) for t in x)
        return F.broadcast(x, self.root_rank, self.group)


class AlltoAll(_CommPrimitive):
    def __init__(self, split_count: int | None = None, split_dim: int = 0, concat_dim: int = 0, group: str | None = None):
        super().__init__()
        self.split_count = split_count
        self.split_dim = split_dim
        self.concat_dim = concat_dim
        self.group = group

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return F.all_to_all(x, self.split_dim, self.concat_dim, self.group)
