"""The job's process topology: every DeviceMesh autopar uses is built here, once, with named axes.

- ``world_mesh()``: the layout modes' mesh, one axis per prime factor of the world size (``f0``, ``f1``, ...), on
  which any MindSpore device matrix lies (:mod:`autopar.layout.axes`).
- ``dp_mesh(shard_size)``: data parallelism -- all ranks on one axis ``dp``, or ``(dp_replicate, dp_shard)`` when
  a parameter is sharded over groups of ``shard_size`` ranks (hybrid ZeRO / HSDP).
- ``pipeline_mesh(stages)``: ``(pp, dp)`` -- rank ``r`` runs stage ``r // dp`` (MindSpore numbers a stage's ranks
  consecutively); ``pipeline_mesh(stages, tensor, context)``: ``(pp, dp, [cp], [tp])``, tensor and context
  parallelism inside the stages.

All are row-major views of the same ranks, so a rank's coordinate on one is a function of its coordinate on
another. Meshes are cached per shape: asking twice gives the same process groups (each costs a rendezvous)."""
from __future__ import annotations

import logging
from functools import lru_cache

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.comm import management as _comm
from autopar.errors import ConfigError
from autopar.layout.axes import current_world_size, mesh_shape_for

# DTensor warns about multi-axis redistributions; they are the price of one mesh for all operators.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def world_size() -> int:
    return current_world_size()


def device() -> torch.device:
    return _comm.device() if _comm.is_initialized() else torch.device("cpu")


@lru_cache(maxsize=None)
def _mesh(shape: tuple[int, ...], names: tuple[str, ...], device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def _build(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    if not dist.is_initialized():
        raise ConfigError("a device mesh needs the cluster: call autopar.communication.init() first")
    return _mesh(tuple(shape), tuple(names), device().type)


def world_mesh() -> DeviceMesh:
    """The layout modes' mesh: one axis per prime factor of the world size."""
    shape = mesh_shape_for(world_size())
    return _build(shape, tuple(f"f{i}" for i in range(len(shape))))


def mesh_shape() -> tuple[int, ...]:
    return mesh_shape_for(world_size())


def dp_mesh(shard_size: int | None = None) -> DeviceMesh:
    """Data-parallel ranks: ``(dp,)``, or ``(dp_replicate, dp_shard)`` for groups of ``shard_size`` ranks."""
    world = world_size()
    if shard_size is None or shard_size >= world:
        return _build((world,), ("dp",))
    if world % shard_size:
        raise ConfigError(f"a shard group of {shard_size} ranks does not divide the {world} ranks")
    return _build((world // shard_size, shard_size), ("dp_replicate", "dp_shard"))


def pipeline_mesh(stages: int, tensor: int = 1, context: int = 1) -> DeviceMesh:
    """``(pp, dp)``: stage-major, as MindSpore numbers the ranks of a pipeline; with ``tensor`` > 1, ``(pp, dp, tp)``
    -- a stage's ranks split into data-parallel replicas of ``tensor`` consecutive ranks each (Megatron's order:
    tensor innermost); with ``context`` > 1 a ``cp`` axis before ``tp`` (Megatron's order: tp, then cp, then dp
    outward), ``(pp, dp, cp)`` or ``(pp, dp, cp, tp)``."""
    world = world_size()
    if world % stages:
        raise ConfigError(f"pipeline_stages={stages} does not divide the {world} ranks")
    if tensor == 1 and context == 1:
        return _build((stages, world // stages), ("pp", "dp"))
    inner = tensor * context
    if (world // stages) % inner:
        what = " x ".join(part for part, n in ((f"a context-parallel degree of {context}", context),
                                               (f"a tensor-parallel degree of {tensor}", tensor)) if n > 1)
        raise ConfigError(f"{what} does not divide the {world // stages} ranks of a pipeline stage")
    axes = [(n, name) for n, name in ((context, "cp"), (tensor, "tp")) if n > 1]
    return _build((stages, world // stages // inner, *[n for n, _ in axes]), ("pp", "dp", *[name for _, name in axes]))
