"""Gradients of the layout modes (SEMI_AUTO / AUTO) and of HYBRID's ``layerwise_parallel`` slices, completed one
parameter at a time inside the backward.

:class:`LayoutGrads` puts one tensor hook on each parameter. It sees the gradient this backward contributes, *before*
it is added to ``.grad``, and returns the completed one:

- a parameter laid out as a DTensor: its gradient redistributed to the parameter's own placements (a partial sum
  over a split contraction is reduced, a replicated parameter's gradient summed over the data-parallel ranks);
- a plain parameter beside them (an unannotated module runs data-parallel on the local batch): all-reduced;

then scaled by ``gradients_mean`` (and by the world size when the loss itself was global). Because the hook acts on
each backward's contribution and not on the accumulated ``.grad``, several backwards before a step accumulate as one
process would, ``torch.autograd.grad`` (MindSpore's ``value_and_grad``) returns completed gradients, and
``clip_grad_norm_`` and the optimizer see gradients equal to one process's on the global batch.

Where the gradient becomes ``.grad`` itself (``.grad`` was None), the hook hands it on untouched and a
post-accumulate hook completes it in place: completing out of place costs a gradient-sized allocation per parameter
(on a CPU host a fresh 64 MiB buffer is 16k page faults, ~80 ms measured here).

:class:`LocalGrads` (HYBRID): the network's own collectives (``ops.AllReduce``) already combined the ranks'
contributions; only ``gradients_mean`` divides them, as for every other parameter.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from autopar.parallel.grads.engine import accumulates, accumulator, claim, release, returns_deferred
from autopar.parallel.memory_id import storage_id


class LayoutGrads:
    name = "layout redistribution"

    def __init__(self, world: int, gradients_mean: bool, loss_was_global: Callable[[], bool] = lambda: False,
                 whole_outputs: Callable[[], bool] = lambda: False):
        self.world = world
        self.gradients_mean = gradients_mean
        self.loss_was_global = loss_was_global
        # full_batch: the network handed every rank the whole outputs, so a loss on them is the one process's and the
        # ranks' contributions add up to its gradient, whatever gradients_mean says (it combines *different* data)
        self.whole_outputs = whole_outputs
        self._pending: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> completed after accumulation
        # parameter -> its AccumulateGrad node, made at its first backward: a parameter the runtime replaced by its
        # slice before any backward keeps none, and is freed as soon as nothing else holds it
        self._nodes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._handles: list = []
        self._sync = True

    def scale(self) -> float:
        if self.whole_outputs():
            return 1.0
        n = self.world
        return (1.0 / n if self.gradients_mean else 1.0) * (n if self.loss_was_global() else 1.0)

    def attach(self, params) -> None:
        """Hook the parameters of ``params`` no engine owns yet: DTensors by their layout, the rest replicated."""
        from torch.distributed.tensor import DTensor

        for p in claim(self, params):
            ref = weakref.ref(p)
            if isinstance(p, DTensor):
                mesh, placements = p.device_mesh, tuple(p.placements)
                self._handles.append(p.register_hook(
                    lambda g, mesh=mesh, placements=placements, ref=ref: self._layout(g, mesh, placements, ref())))
            else:
                self._handles.append(p.register_hook(lambda g, ref=ref: self._replicated(g, ref())))
            self._handles.append(p.register_post_accumulate_grad_hook(self._finish_in_place))

    @contextlib.contextmanager
    def no_sync(self):
        # a contribution completed in its own backward is exact whenever it is completed: nothing to postpone
        yield

    # -- completing a gradient where it lies -----------------------------------------------------------------
    # The hooks must not change the gradient they are handed in place: autograd may hand the same tensor to several
    # inputs. When this backward's gradient becomes ``.grad`` itself, the post-accumulate hook completes ``.grad`` in
    # place -- if nothing else shares its storage.
    def _defer(self, param: torch.nn.Parameter | None) -> bool:
        if param is None or param.grad is not None or not accumulates(self._node(param)):
            return False
        self._pending[param] = True
        return True

    def _node(self, param: torch.nn.Parameter):
        node = self._nodes.get(param)
        if node is None:
            node = self._nodes[param] = accumulator(param)
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
            for dim, (have, want) in enumerate(zip(g.placements, tuple(param.placements))):
                if have != want:  # Partial(sum) -> Replicate (what _deferrable admits)
                    dist.all_reduce(local, group=g.device_mesh.get_group(dim))
        elif self.world > 1:
            dist.all_reduce(local)
        s = self.scale()
        if s != 1.0:
            local.mul_(s)
        if isinstance(g, DTensor) and tuple(g.placements) != tuple(param.placements):
            param.grad = DTensor.from_local(local, g.device_mesh, tuple(param.placements), run_check=False)

    # -- the hooks (they run inside the backward, in the same order on every rank) ----------------------------
    def _scaled(self, g: torch.Tensor, copy: bool) -> torch.Tensor:
        s = self.scale()
        if s != 1.0:
            return g * s
        return g.clone() if copy else g

    def _layout(self, g, mesh, placements, param):
        if _deferrable(g, placements) and self._defer(param):
            return g
        return self._layout_out_of_place(g, mesh, placements)

    def _layout_out_of_place(self, g, mesh, placements):
        from torch.distributed.tensor import DTensor

        if isinstance(g, DTensor) and tuple(g.placements) != placements:
            before = storage_id(g._local_tensor)
            g = g.redistribute(mesh, placements)
            s = self.scale()
            if s != 1.0 and storage_id(g._local_tensor) != before:
                # a fresh tensor (the all-reduce of a partial sum is out of place): scale it where it lies instead
                # of allocating and faulting in another gradient-sized buffer
                with torch.no_grad():
                    g._local_tensor.mul_(s)
                return g
        return self._scaled(g, copy=False)

    def _replicated(self, g: torch.Tensor, param) -> torch.Tensor:
        if self._defer(param):
            return g
        return self._replicated_out_of_place(g)

    def _replicated_out_of_place(self, g: torch.Tensor) -> torch.Tensor:
        # never in place: autograd may hand the same tensor to several inputs (the gradient of an addition)
        g = self._scaled(g, copy=True)
        if self.world > 1:
            dist.all_reduce(g)
        return g

    def complete_returned(self, params, grads) -> list[torch.Tensor]:
        return list(grads)  # completed by the hooks as autograd returned them

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        release(self)


class LocalGrads:
    """``layerwise_parallel`` slices: each backward's contribution scaled by ``gradients_mean``, nothing summed."""

    name = "layerwise (the network's own collectives)"

    def __init__(self, params, world: int, gradients_mean: bool):
        self.scale = 1.0 / world if gradients_mean and world > 1 else 1.0
        self._handles = []
        for p in claim(self, params):
            node = accumulator(p)
            self._handles.append(p.register_hook(lambda g, node=node: self._local(g, node)))

    def _local(self, g: torch.Tensor, node) -> torch.Tensor:
        if self.scale == 1.0 or (not accumulates(node) and returns_deferred()):
            return g
        return g * self.scale

    @contextlib.contextmanager
    def no_sync(self):
        yield

    def complete_returned(self, params, grads) -> list[torch.Tensor]:
        return [g * self.scale if self.scale != 1.0 else g for g in grads]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        release(self)


def _deferrable(g, placements) -> bool:
    """Can ``g`` be completed in place on the parameter's own placements: equal, or partial sums to replicate?"""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not isinstance(g, DTensor):
        return False
    return all(have == want or (isinstance(have, Partial) and have.reduce_op == "sum" and isinstance(want, Replicate))
               for have, want in zip(g.placements, placements))
