"""A network parallelizes itself on its first call: the user's loop needs nothing from autopar.

MindSpore compiles a network for the parallel context when it is first called; torch users call ``DDP(model)`` or
``fully_shard(model)`` first. Here neither is needed: while a parallel mode is set (``set_auto_parallel_context``),
torch's global module hooks watch for the first *outermost* call -- a module called while no other module is
running -- of a network after ``init()``, and parallelize it in place (:func:`autopar.parallel.api.attach`).
A global optimizer step pre-hook moves any optimizer onto the parameters that train now (one made before the first
forward holds the originals) and gives it the fused kernel where that is a speed default (:mod:`autopar.perf`);
``GradScaler``, which reads the gradients before the step, moves it first too.

Left alone: networks already parallelized (their state says how they run), calls autopar makes itself while
:func:`suspended` (the planner's trace, a pipeline's stages), operators called outside a network, training wrappers
(``TrainOneStepCell``: the network inside is the one to parallelize), modules without trainable parameters or
strategies (losses, metrics), torch's own parallel wrappers (DDP, FSDP: the user chose them), and gradient-free calls
in the data-parallel modes (evaluation). The hooks are removed by ``reset_auto_parallel_context()``.
"""
from __future__ import annotations

import sys
import threading
import weakref

import torch
from torch.nn.modules import module as _module
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar import context as _context
from autopar.comm import management as _comm
from autopar.common.replaced import remap_optimizer

_state = threading.local()  # depth of module calls on this thread
_handles: list = []
_tuned: weakref.WeakSet = weakref.WeakSet()  # optimizers the step pre-hook has looked at


def install() -> None:
    """Idempotent; called when a parallel mode is set (``context.on_parallel_mode``)."""
    if _handles:
        return
    from autopar.common import deferred

    deferred.taken_by(_lays_out_first_calls)
    _handles.append(_module.register_module_forward_pre_hook(_pre))
    _handles.append(_module.register_module_forward_hook(_post, always_call=True))
    _handles.append(register_optimizer_step_pre_hook(_before_step))
    _handles.append(_ScalerUnscales())


def uninstall() -> None:
    """Remove the global hooks (``reset_auto_parallel_context``); networks parallelized before keep their state."""
    while _handles:
        _handles.pop().remove()
    _state.depth = 0


class _ScalerUnscales:
    """Loss scaling reads the optimizer's gradients before its step (``GradScaler.unscale_`` -- called by its
    ``step`` or by the user before clipping -- or its found-inf check for a fused optimizer): the optimizer is moved
    onto the parameters that train first, as the step pre-hook moves it -- else a ZeRO or layout run's first step
    found no gradient to unscale, and stopped ("No inf checks were recorded for this optimizer"; fused AdamW: "'int'
    object has no attribute 'device'"). Undone by ``remove``, like a hook handle."""

    # where torch's GradScaler reads them: unscale_ and, for an optimizer that unscales inside its fused step,
    # _check_inf_per_device both go through _unscale_grads_
    _READS = "_unscale_grads_"

    def __init__(self) -> None:
        from torch.amp import grad_scaler

        self._reads = getattr(grad_scaler.GradScaler, self._READS)
        reads = self._reads

        def unscale_grads(scaler, optimizer, *args, **kwargs):
            remap_optimizer(optimizer)
            return reads(scaler, optimizer, *args, **kwargs)

        setattr(grad_scaler.GradScaler, self._READS, unscale_grads)

    def remove(self) -> None:
        from torch.amp import grad_scaler

        setattr(grad_scaler.GradScaler, self._READS, self._reads)


def _lays_out_first_calls(module: torch.nn.Module) -> bool:
    """Will a network called now be parallelized here (so that a meta-built one is materialised by its mode, each
    rank only its slices), rather than run as it is?"""
    return bool(_handles) and not _context.is_managed() and _comm.is_initialized() and (
        _context.parallel_mode() is not _context.ParallelMode.STAND_ALONE)


def suspended():
    """Calls autopar makes itself (a trace, a pipeline schedule) -- or a user's reference computed in one process
    (``autopar.context.managed()``, the same flag): no network parallelizes itself inside."""
    return _context.managed()


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
    from autopar.parallel.state import state_of

    state = state_of(module)
    if state is None:
        return _first_call(module, args)
    runtime = state.runtime
    if runtime is not None and not runtime.is_root(module):
        runtime.add_root(module)  # e.g. the backbone of a WithLossCell that trained first: same parameters
        return runtime.enter_first_call(module, args, call_kwargs(module))
    for engine in state.engines:  # a part of the network called on its own: its outputs end the backward too
        watch = getattr(engine, "watch_once", None)
        if watch is not None:
            watch(module)
    return None


def _post(module: torch.nn.Module, args: tuple, output):
    if not _is_wrapper(module):
        _state.depth = max(getattr(_state, "depth", 1) - 1, 0)
    return None


def call_kwargs(module: torch.nn.Module) -> dict:
    """The keyword inputs of the call of ``module`` now under way (``model(input_ids=x, labels=y)``): torch gives a
    global forward pre-hook only the positional ones, so they are read from the frame of ``Module._call_impl``
    that runs the hooks (its ``kwargs`` dict is the one ``forward`` receives: converted in place, the call sees
    the conversion). Empty where no such frame is found."""
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        local = frame.f_locals
        if local.get("self") is module and isinstance(local.get("kwargs"), dict) and "args" in local:
            return local["kwargs"]
        frame = frame.f_back
    return {}


def _first_call(module: torch.nn.Module, args: tuple):
    from torch.nn.parallel import DistributedDataParallel

    from autopar.ops.primitive import Primitive
    from autopar.parallel import api

    if isinstance(module, DistributedDataParallel) or type(module).__name__.startswith("FSDP"):
        return None
    if isinstance(module, Primitive):  # an operator called outside any network runs locally, as in PyNative
        return None
    trainable = any(p.requires_grad for p in module.parameters())
    if not trainable and not api.has_strategies(module):
        return _runs_as_it_is(module)
    ctx = _context.auto_parallel_context()
    if not api.lays_out(module, None, ctx) and not torch.is_grad_enabled():
        return _runs_as_it_is(module)  # evaluation in the data-parallel modes: replicas compute alone
    kwargs = call_kwargs(module)
    state = api.attach(module, sample=list(args), sample_kwargs=kwargs)
    if state.zero_level:  # sharded inside its own call: FSDP's root pre-forward by hand
        from autopar.parallel.zero.fsdp import enter_first_call

        return enter_first_call(module, args, kwargs)
    if state.runtime is not None:
        return state.runtime.enter_first_call(module, args, kwargs)
    return None


def _runs_as_it_is(module: torch.nn.Module) -> None:
    """Not parallelized: a network built on the meta device is materialised whole."""
    from autopar.common import deferred

    deferred.make_whole(module, device=_comm.device())
    return None


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs):
    remap_optimizer(optimizer)
    if optimizer not in _tuned:
        _tuned.add(optimizer)
        from autopar.parallel.grads.engine import owner_of
        from autopar.perf.tuning import tune_optimizer

        if any(owner_of(p) is not None for g in optimizer.param_groups for p in g["params"]):
            tune_optimizer(optimizer)  # the speed defaults Model applies, for the plain loop too
    return None
