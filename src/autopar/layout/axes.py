"""How a device matrix lies on the world mesh: pure arithmetic on shapes, usable without a running job (the planner
plans for clusters that do not exist).

MindSpore gives every operator its own device matrix (e.g. ``(2, 2)`` for ``((2, 2), (2, 1))`` on 4 devices,
``(4,)`` for another op). DTensor can only redistribute between tensors on the *same* mesh, so the job has one
world mesh whose axes are the prime factors of the device count (4 -> (2, 2), 8 -> (2, 2, 2)), and each
device-matrix axis maps onto a run of consecutive mesh axes: with row-major rank numbering on both sides, a
device-matrix axis of size 4 on mesh axes (0, 1) is exactly DTensor's nested ``(Shard(d), Shard(d))``.
"""
from __future__ import annotations

import math

from autopar.errors import StrategyError


def prime_factors(n: int) -> tuple[int, ...]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return tuple(out)


def mesh_shape_for(device_num: int) -> tuple[int, ...]:
    """The world mesh of ``device_num`` devices (also for planning a job that is not running)."""
    return prime_factors(device_num) or (1,)


def current_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def current_mesh_shape() -> tuple[int, ...]:
    """The world mesh's shape in this job (``(1,)`` before ``init()``)."""
    return mesh_shape_for(current_world_size())


def axes_of_device_matrix(device_matrix: tuple[int, ...], shape: tuple[int, ...] | None = None
                          ) -> list[tuple[int, ...]]:
    """For each device-matrix axis, the consecutive mesh axes it covers (row-major order on both sides)."""
    shape = current_mesh_shape() if shape is None else shape
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


def mesh_axes(device_matrix: tuple[int, ...], axes: tuple[int, ...]) -> list[int]:
    """The world-mesh axes that device-matrix ``axes`` cover."""
    groups = axes_of_device_matrix(device_matrix)
    return [m for a in axes for m in groups[a]]
