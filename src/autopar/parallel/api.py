"""Turn a network into the thing a training step runs, according to the parallel context.

``prepare(network)`` returns a :class:`Prepared`: the module to call (a DDP wrapper in DATA_PARALLEL), the
context manager that suppresses gradient communication during accumulation, and the hook to run after backward.
One object per mode; the training step never branches on the mode itself.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch

from autopar import context as _context
from autopar.comm import management as _comm
from autopar.context import ParallelMode
from autopar.errors import ConfigError


@dataclass
class Prepared:
    mode: ParallelMode
    module: torch.nn.Module  # what the step calls
    network: torch.nn.Module  # the user's network (for eval, checkpoints)
    device: torch.device
    world_size: int = 1
    no_sync: Callable[[], ContextManager] = field(default=contextlib.nullcontext)
    after_backward: Callable[[bool], None] = field(default=lambda loss_is_global: None)


def _mode() -> ParallelMode:
    return _context.auto_parallel_context().parallel_mode


def prepare(network: torch.nn.Module, mode: ParallelMode | None = None) -> Prepared:
    mode = mode or _mode()
    if mode is not ParallelMode.STAND_ALONE and not _comm.is_initialized():
        raise ConfigError(f"parallel_mode={mode.value} needs the cluster: call autopar.communication.init() first")
    device = _comm.device() if _comm.is_initialized() else torch.device("cpu")
    network.to(device)
    world = _comm.get_group_size() if _comm.is_initialized() else 1
    if mode is ParallelMode.STAND_ALONE:
        return Prepared(mode, network, network, device, world)
    if mode is ParallelMode.DATA_PARALLEL:
        from autopar.parallel.data_parallel import wrap_data_parallel

        ctx = _context.auto_parallel_context()
        ddp = wrap_data_parallel(network, gradients_mean=ctx.gradients_mean,
                                 parameter_broadcast=ctx.parameter_broadcast, device=device)
        return Prepared(mode, ddp, network, device, world, no_sync=ddp.no_sync)
    raise NotImplementedError(f"parallel_mode={mode.value} is not implemented yet")
