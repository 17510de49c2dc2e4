"""Small conversions between local tensors and DTensors on the world mesh, used at every operator boundary."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autopar.parallel.layout import Layout
from autopar.parallel.mesh import axes_of_device_matrix, data_parallel_placements, mesh_shape, replicate_placements
from autopar.parallel.mesh import world_mesh, world_size

_PARTIAL_OP = {"sum": "sum", "avg": "avg"}


def mesh_axes(device_matrix: tuple[int, ...], axes: tuple[int, ...]) -> list[int]:
    groups = axes_of_device_matrix(device_matrix)
    return [m for a in axes for m in groups[a]]


def placements_for(layout: Layout, partial_axes: tuple[int, ...] = (), reduction: str = "sum",
                   grad_partial: bool = False):
    """Placements of ``layout``; mesh axes of ``partial_axes`` become Partial (of ``reduction``, or sum for
    gradients)."""
    out = list(layout.placements())
    for m in mesh_axes(layout.device_matrix, partial_axes):
        out[m] = Partial("sum") if grad_partial else Partial(_PARTIAL_OP[reduction])
    return tuple(out)


def output_placements(device_matrix, output_map, partial_axes, reduction, shape: tuple[int, ...] | None = None):
    shape = mesh_shape() if shape is None else shape
    out = [Replicate() for _ in shape]
    groups = axes_of_device_matrix(device_matrix, shape)
    for dim, axis in enumerate(output_map):
        if axis >= 0:
            for m in groups[axis]:
                out[m] = Shard(dim)
    for axis in partial_axes:
        for m in groups[axis]:
            out[m] = Partial(_PARTIAL_OP[reduction])
    return tuple(out)


def wrap_local(local: torch.Tensor, placements) -> DTensor:
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


def is_data_parallel(t: DTensor) -> bool:
    return tuple(t.placements) == data_parallel_placements(t.dim())


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
