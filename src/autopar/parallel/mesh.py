"""The one DeviceMesh every sharded tensor of the job lives on, and how device matrices map onto it.

MindSpore gives every operator its own device matrix (e.g. ``(2, 2)`` for ``((2, 2), (2, 1))`` on 4 devices,
``(4,)`` for another op). DTensor can only redistribute between tensors on the *same* mesh, so autopar builds one
world mesh whose axes are the prime factors of the device count (4 -> (2, 2), 8 -> (2, 2, 2)) and maps each
device-matrix axis onto a run of consecutive mesh axes: with row-major rank numbering on both sides, a
device-matrix axis of size 4 on mesh axes (0, 1) is exactly DTensor's nested ``(Shard(d), Shard(d))``.
"""
from __future__ import annotations

import logging
import math
from functools import lru_cache

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.comm import management as _comm
from autopar.errors import StrategyError

# DTensor warns about multi-axis redistributions; they are the price of one mesh for all operators.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def prime_factors(n: int) -> tuple[int, ...]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return tuple(out)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@lru_cache(maxsize=None)
def _mesh(shape: tuple[int, ...], device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, shape, mesh_dim_names=tuple(f"m{i}" for i in range(len(shape))))


def world_mesh() -> DeviceMesh:
    """The job's mesh (built once; every sharded tensor uses it)."""
    n = world_size()
    shape = prime_factors(n) or (1,)
    return _mesh(shape, _comm.device().type if _comm.is_initialized() else "cpu")


def flat_mesh() -> DeviceMesh:
    """All ranks on one axis: what optimizer sharding splits parameters over."""
    return _mesh((world_size(),), _comm.device().type if _comm.is_initialized() else "cpu")


def mesh_of_shape(shape: tuple[int, ...]) -> DeviceMesh:
    """Another view of the same ranks (row-major), e.g. the (groups, group size) mesh of hybrid sharding."""
    return _mesh(tuple(shape), _comm.device().type if _comm.is_initialized() else "cpu")


def mesh_shape() -> tuple[int, ...]:
    return tuple(world_mesh().shape)


def mesh_shape_for(device_num: int) -> tuple[int, ...]:
    """The world mesh of ``device_num`` devices (also for planning a job that is not running)."""
    return prime_factors(device_num) or (1,)


def axes_of_device_matrix(device_matrix: tuple[int, ...], shape: tuple[int, ...] | None = None
                          ) -> list[tuple[int, ...]]:
    """For each device-matrix axis, the consecutive mesh axes it covers (row-major order on both sides)."""
    shape = mesh_shape() if shape is None else shape
    if math.prod(device_matrix) != math.prod(shape):
        raise StrategyError(f"device matrix {device_matrix} does not cover the {math.prod(shape)} devices")
    out, m = [], 0
    for size in device_matrix:
        start, prod = m, 1
        while prod < size and m < len(shape):
            prod *= shape[m]
            m += 1
        if prod != size:
            raise StrategyError(
                f"device matrix {device_matrix} cannot be laid on {math.prod(shape)} devices "
                f"(mesh {shape}): an axis of size {size} is not a product of consecutive mesh axes"
            )
        out.append(tuple(range(start, m)))
    if shape == (1,) and not device_matrix:
        return []
    return out


def data_parallel_placements(ndim: int):
    """Dimension 0 split over every device: how each rank's local batch sits in the global batch."""
    from torch.distributed.tensor import Replicate, Shard

    if ndim == 0 or world_size() == 1:
        return tuple(Replicate() for _ in mesh_shape())
    return tuple(Shard(0) for _ in mesh_shape())


def replicate_placements():
    from torch.distributed.tensor import Replicate

    return tuple(Replicate() for _ in mesh_shape())


def device() -> torch.device:
    return _comm.device() if _comm.is_initialized() else torch.device("cpu")
