"""Gradients completed during the backward pass, from hooks on the parameters: no call needed in the user's loop.

Each trainable parameter of a parallelized network carries one tensor hook (``Tensor.register_hook``). It sees the
gradient this backward contributes, *before* it is added to ``.grad``, and returns the completed one:

- a parameter laid out as a DTensor: its gradient redistributed to the parameter's own placements (a partial sum
  over a split contraction is reduced, a replicated parameter's gradient summed over the data-parallel ranks);
- a replicated plain parameter (data parallel, and unannotated modules in the layout modes): all-reduced;
- a ``layerwise_parallel`` parameter (hybrid parallel): left to the network's own collectives;

and then scaled by ``gradients_mean`` (and by the world size when the loss itself was global). Because the hook
acts on each backward's contribution and not on the accumulated ``.grad``, everything a torch loop does stays
exact: several backwards before a step accumulate as one process would, ``zero_grad()`` with or without
``set_to_none`` needs nothing, ``torch.autograd.grad`` (MindSpore's ``value_and_grad``) returns completed
gradients, and ``clip_grad_norm_`` and the optimizer see gradients equal to one process's on the global batch.

Why hooks and not torch's DDP here: DDP's reducer expects every backward to follow a forward through its wrapper,
so a loop that calls the inner network, a sub-module or ``autograd.grad`` would silently skip the reduction.
``Model.train`` in DATA_PARALLEL keeps DDP (bucketed and overlapped with the backward: the measured fast path).
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from autopar import context as _context

REPLICATED, LAYOUT, LOCAL = "replicated", "layout", "local"


class GradSync:
    def __init__(self, world: int, gradients_mean: bool, loss_was_global: Callable[[], bool] = lambda: False,
                 yields_to_ddp: bool = False):
        self.world = world
        self.gradients_mean = gradients_mean
        self.loss_was_global = loss_was_global
        # the network is also wrapped in DDP by Model: inside Model's own steps DDP reduces, the hooks stand aside
        self.yields_to_ddp = yields_to_ddp
        self.hooked: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> its kind
        self._pending: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> completed after accumulation
        self._nodes: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> its AccumulateGrad node

    def scale(self) -> float:
        n = self.world
        return (1.0 / n if self.gradients_mean else 1.0) * (n if self.loss_was_global() else 1.0)

    def attach(self, param: torch.nn.Parameter, kind: str) -> None:
        if param in self.hooked or not param.requires_grad or getattr(param, "_autopar_grad_sync", False):
            return  # one hook per parameter, whichever network (or wrapper) reached it first
        param._autopar_grad_sync = True
        ref = weakref.ref(param)
        if kind == LAYOUT:
            mesh, placements = param.device_mesh, tuple(param.placements)
            param.register_hook(lambda g: self._layout(g, mesh, placements, ref))
            param.register_post_accumulate_grad_hook(self._finish_in_place)
        elif kind == REPLICATED:
            param.register_hook(lambda g: self._replicated(g, ref))
            param.register_post_accumulate_grad_hook(self._finish_in_place)
        else:
            param.register_hook(self._local)
        self.hooked[param] = kind

    # -- completing a gradient where it lies -----------------------------------------------------------------
    # The hooks below must not change the gradient they are handed in place: autograd may hand the same tensor to
    # several inputs. Completing it out of place costs a gradient-sized allocation and pass per parameter -- on a
    # CPU host a fresh 64 MiB buffer is 16k page faults (~80 ms measured here). When this backward's gradient becomes
    # the parameter's ``.grad`` itself (``.grad`` was None, the engine will accumulate it), the hook hands it on
    # untouched and the post-accumulate hook completes ``.grad`` in place -- if nothing else shares its storage.
    def _defer(self, param: torch.nn.Parameter | None) -> bool:
        if param is None or param.grad is not None or self.yields_to_ddp and _context.is_managed():
            return False
        node = self._accumulator(param)
        try:
            if not torch._C._will_engine_execute_node(node):
                return False  # backward(inputs=...) without this parameter
        except RuntimeError:  # torch.autograd.grad: nothing is accumulated, the gradient is returned
            return False
        self._pending[param] = True
        return True

    def _accumulator(self, param: torch.nn.Parameter):
        node = self._nodes.get(param)
        if node is None:
            with torch.enable_grad():  # the backward runs without grad mode: no graph, no node, otherwise
                node = self._nodes[param] = param.view_as(param).grad_fn.next_functions[0][0]
        return node

    def _finish_in_place(self, param: torch.nn.Parameter) -> None:
        if not self._pending.pop(param, False):
            return
        from torch.distributed.tensor import DTensor

        g = param.grad
        local = g._local_tensor if isinstance(g, DTensor) else g
        if torch._C._storage_Use_Count(local.untyped_storage()._cdata) > 2:  # shared: complete it out of place
            param.grad = (self._layout_out_of_place(g, param.device_mesh, tuple(param.placements))
                          if isinstance(g, DTensor) else self._replicated_out_of_place(g))
            return
        if isinstance(g, DTensor):
            target = tuple(param.placements)
            for dim, (have, want) in enumerate(zip(g.placements, target)):
                if have != want:  # Partial(sum) -> Replicate (what _deferrable admits)
                    dist.all_reduce(local, group=g.device_mesh.get_group(dim))
        elif self.world > 1:
            dist.all_reduce(local)
        s = self.scale()
        if s != 1.0:
            local.mul_(s)
        if isinstance(g, DTensor) and tuple(g.placements) != tuple(param.placements):
            param.grad = DTensor.from_local(local, g.device_mesh, tuple(param.placements), run_check=False)

    def attach_module(self, module: torch.nn.Module) -> None:
        """Every trainable parameter of ``module``: a DTensor by its layout, a layerwise one as local, the rest
        replicated."""
        from torch.distributed.tensor import DTensor

        for p in module.parameters():
            if isinstance(p, DTensor):
                self.attach(p, LAYOUT)
            elif getattr(p, "layerwise_parallel", False):
                self.attach(p, LOCAL)
            else:
                self.attach(p, REPLICATED)

    # -- the hooks (they run inside the backward, in the same order on every rank) ----------------------------
    def _scaled(self, g: torch.Tensor, copy: bool) -> torch.Tensor:
        s = self.scale()
        if s != 1.0:
            return g * s
        return g.clone() if copy else g

    def _layout(self, g, mesh, placements, ref=None):
        if _deferrable(g, placements) and self._defer(ref() if ref else None):
            return g
        return self._layout_out_of_place(g, mesh, placements)

    def _layout_out_of_place(self, g, mesh, placements):
        from torch.distributed.tensor import DTensor

        if isinstance(g, DTensor) and tuple(g.placements) != placements:
            before = g._local_tensor.untyped_storage().data_ptr()
            g = g.redistribute(mesh, placements)
            s = self.scale()
            if s != 1.0 and g._local_tensor.untyped_storage().data_ptr() != before:
                # a fresh tensor (the all-reduce of a partial sum is out of place): scale it where it lies instead
                # of allocating and faulting in another gradient-sized buffer
                with torch.no_grad():
                    g._local_tensor.mul_(s)
                return g
        return self._scaled(g, copy=False)

    def _replicated(self, g: torch.Tensor, ref=None) -> torch.Tensor:
        if self.yields_to_ddp and _context.is_managed():
            return g
        if self._defer(ref() if ref else None):
            return g
        return self._replicated_out_of_place(g)

    def _replicated_out_of_place(self, g: torch.Tensor) -> torch.Tensor:
        # never in place: autograd may hand the same tensor to several inputs (the gradient of an addition)
        g = self._scaled(g, copy=True)
        if self.world > 1:
            dist.all_reduce(g)
        return g

    def _local(self, g: torch.Tensor) -> torch.Tensor:
        if self.yields_to_ddp and _context.is_managed():
            return g
        return self._scaled(g, copy=False)


def _deferrable(g, placements) -> bool:
    """Can ``g`` be completed in place on the parameter's own placements: equal, or partial sums to replicate?"""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not isinstance(g, DTensor):
        return False
    return all(have == want or (isinstance(have, Partial) and have.reduce_op == "sum" and isinstance(want, Replicate))
               for have, want in zip(g.placements, placements))


def sync_of(module: torch.nn.Module) -> GradSync | None:
    return module.__dict__.get("_autopar_sync")


def mark(module: torch.nn.Module, sync: GradSync) -> None:
    for m in module.modules():
        m.__dict__["_autopar_sync"] = sync
