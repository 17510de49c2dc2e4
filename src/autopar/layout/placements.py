"""DTensor placements from device matrices and tensor maps: what a layout or an operator's output means on the world
mesh. Pure (no tensors, no mesh objects): the runtime and the planner read the same answers."""
from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.layout.axes import axes_of_device_matrix, current_mesh_shape, mesh_axes
from autopar.layout.layout import Layout

PARTIAL_OP = {"sum": "sum", "avg": "avg", "max": "max", "min": "min"}  # DTensor Partial takes each


def placements_for(layout: Layout, partial_axes: tuple[int, ...] = (), reduction: str = "sum",
                   grad_partial: bool = False):
    """Placements of ``layout``; mesh axes of ``partial_axes`` become Partial (of ``reduction``, or sum for
    gradients)."""
    out = list(layout.placements())
    for m in mesh_axes(layout.device_matrix, partial_axes):
        out[m] = Partial("sum") if grad_partial else Partial(PARTIAL_OP[reduction])
    return tuple(out)


def output_placements(device_matrix, output_map, partial_axes, reduction, shape: tuple[int, ...] | None = None):
    shape = current_mesh_shape() if shape is None else shape
    out = [Replicate() for _ in shape]
    groups = axes_of_device_matrix(device_matrix, shape)
    for dim, axis in enumerate(output_map):
        if axis >= 0:
            for m in groups[axis]:
                out[m] = Shard(dim)
    for axis in partial_axes:
        for m in groups[axis]:
            out[m] = Partial(PARTIAL_OP[reduction])
    return tuple(out)


def replicate_placements(shape: tuple[int, ...] | None = None) -> tuple:
    return tuple(Replicate() for _ in (current_mesh_shape() if shape is None else shape))


def data_parallel_placements(ndim: int, shape: tuple[int, ...] | None = None) -> tuple:
    """Dimension 0 split over every device: how each rank's local batch sits in the global batch."""
    shape = current_mesh_shape() if shape is None else shape
    if ndim == 0 or shape == (1,):
        return tuple(Replicate() for _ in shape)
    return tuple(Shard(0) for _ in shape)
