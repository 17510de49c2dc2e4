"""A network parallelizes itself on its first call: the user's loop needs nothing from autopar.

MindSpore compiles a network for the parallel context when it is first called; torch users call ``DDP(model)`` or
``fully_shard(model)`` first. Here neither is needed: once a parallel mode is set (``set_auto_parallel_context``),
torch's global module hooks watch for the first *outermost* call -- a module called while no other module is
running -- of a network in a parallel mode after ``init()``, and parallelize it in place
(:func:`autopar.parallel.api.parallelize`): SEMI_AUTO/AUTO lay its parameters out, DATA/HYBRID attach gradient hooks.
A global optimizer step pre-hook moves any optimizer onto the parameters that train now (one made before the first
forward holds the originals). Calls that autopar makes itself (``Model``'s steps, the planner's trace) run inside
``context.managed()`` and are left alone, as are operators called outside a network, training wrappers (``TrainOneStepCell``: the network inside is the
one to parallelize), modules without trainable parameters or strategies (losses, metrics), torch's own parallel
wrappers (DDP, FSDP: the user chose them), and gradient-free calls in the data-parallel modes (evaluation).
"""
from __future__ import annotations

import threading

import torch
from torch.nn.modules import module as _module
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar import context as _context
from autopar.comm import management as _comm
from autopar.common.replaced import remap_optimizer

_state = threading.local()
_installed = False


def install() -> None:
    """Idempotent; called when a parallel mode is first set (``context.on_parallel_mode``)."""
    global _installed
    if _installed:
        return
    _installed = True
    _module.register_module_forward_pre_hook(_pre)
    _module.register_module_forward_hook(_post, always_call=True)
    register_optimizer_step_pre_hook(_before_step)


def _is_wrapper(module: torch.nn.Module) -> bool:
    return getattr(module, "_autopar_step_wrapper", False)


def _pre(module: torch.nn.Module, args: tuple):
    if _is_wrapper(module):
        return None
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    if depth or _context.is_managed() or _context.parallel_mode() is _context.ParallelMode.STAND_ALONE:
        return None
    if not _comm.is_initialized():
        return None
    state = module.__dict__
    runtime = state.get("_autopar_runtime")
    if runtime is not None:
        if runtime.is_root(module):
            return None  # its own hooks run this call
        runtime.add_root(module)  # e.g. the backbone of a WithLossCell that trained first: same parameters
        return runtime.enter_first_call(module, args)
    if "_autopar_sync" in state:
        return None
    return _first_call(module, args)


def _post(module: torch.nn.Module, args: tuple, output):
    if not _is_wrapper(module):
        _state.depth = max(getattr(_state, "depth", 1) - 1, 0)
    return None


def _first_call(module: torch.nn.Module, args: tuple):
    from torch.nn.parallel import DistributedDataParallel

    from autopar.ops.primitive import Primitive
    from autopar.parallel import api

    if isinstance(module, DistributedDataParallel) or type(module).__name__.startswith("FSDP"):
        return None
    if isinstance(module, Primitive):  # an operator called outside any network runs locally, as in PyNative
        return None
    layouts = api._layout_mode(module)
    trainable = any(p.requires_grad for p in module.parameters())
    if not layouts:
        if trainable and torch.is_grad_enabled():
            api.parallelize(module)
            from autopar.parallel.zero import fsdp as optimizer_shard

            if optimizer_shard.is_sharded(module):  # sharded inside its own call: FSDP's root pre-forward by hand
                return optimizer_shard.enter_first_call(module, args)
        return None
    if not trainable and not api.has_strategies(module):
        return None
    api.parallelize(module, sample=list(args))
    runtime = api.runtime_of(module)
    return runtime.enter_first_call(module, args) if runtime is not None else None


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs):
    remap_optimizer(optimizer)
    return None
