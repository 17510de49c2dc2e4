"""Small conversions between local tensors and DTensors on the world mesh, used at every operator boundary (the
placement arithmetic itself is :mod:`autopar.layout.placements`)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.comm.topology import world_mesh, world_size
from autopar.layout.axes import mesh_axes
from autopar.layout.placements import (  # noqa: F401  (the runtime reads them all from here)
    data_parallel_placements,
    output_placements,
    placements_for,
    replicate_placements,
)


def splits(p) -> bool:
    """Does placement ``p`` split its dimension: a ``Shard``, or a ``_StridedShard`` (a split nested inside another
    axis's split of the same dimension -- sequence parallelism inside context parallelism's slices), which torch
    does not make a ``Shard`` subclass?"""
    return p.is_shard() or isinstance(p, _StridedShard)


def strided_axes(placements) -> list:
    """The ``_StridedShard`` placements among ``placements``: more than one where a sequence split over several
    mesh axes was flattened with the batch (torch's view rule puts one on each axis)."""
    return [p for p in placements if isinstance(p, _StridedShard)]


def row_major(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def wrap_local(local: torch.Tensor, placements) -> DTensor:
    if local.numel() and local.is_contiguous() and local.stride() != row_major(local.shape):
        # contiguous with an odd stride on a size-1 dimension (``rows[:, 1:].contiguous()`` of a batch of one):
        # DTensor scales that stride to the global shape, where a later ``view`` then fails
        local = local.clone(memory_format=torch.contiguous_format)
    return DTensor.from_local(local, world_mesh(), placements, run_check=False)


def to_dtensor_replicated(t: torch.Tensor) -> DTensor:
    return wrap_local(t, replicate_placements())


def wrap_data_parallel(local: torch.Tensor) -> DTensor:
    """A rank's local batch (dimension 0 = its shard of the global batch) as a DTensor."""
    return wrap_local(local, data_parallel_placements(local.dim()))


def to_data_parallel_local(t: DTensor) -> torch.Tensor:
    """Back to this rank's share of the batch: dimension 0 split over every device if it divides, else the
    whole (replicated) tensor."""
    n = world_size()
    if t.dim() >= 1 and t.shape[0] % n == 0 and t.shape[0] >= n:
        target = data_parallel_placements(t.dim())
        if tuple(t.placements) != target:
            t = t.redistribute(world_mesh(), target)
        return t.to_local()
    return t.full_tensor()


class _AllReduceExtreme(torch.autograd.Function):
    """max/min over the mesh axes where a reduced dimension was split: the forward reduces the local extremes,
    the backward passes the gradient only where the local extreme is the global one (DTensor's Partial(max)
    cannot be differentiated on local shards)."""

    @staticmethod
    def forward(ctx, local, groups, op):
        out = local.detach().clone()
        for group in groups:
            dist.all_reduce(out, op=op, group=group)
        ctx.save_for_backward(local, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        local, out = ctx.saved_tensors
        return grad * (local == out).to(grad.dtype), None, None


def all_reduce_extreme(local: torch.Tensor, device_matrix, axes, reduction: str) -> torch.Tensor:
    mesh = world_mesh()
    groups = [mesh.get_group(m) for m in mesh_axes(device_matrix, axes)]
    op = dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.MIN
    return _AllReduceExtreme.apply(local, groups, op)
