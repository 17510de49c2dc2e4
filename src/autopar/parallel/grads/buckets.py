"""DATA_PARALLEL for ranks on one CPU host: gradients that live in shared memory, summed there.

Why not DDP with a communication hook: DDP copies every gradient into its own bucket, and a hook would copy the
bucket into shared memory and the sum back out -- three gradient-sized copies a step before any sum. Here each
parameter's ``.grad`` *is* a view of this rank's region of the shared segment (:class:`~autopar.comm.host_memory.
HostGroup`): the gradient the backward produces is copied there (the copy DDP makes into its bucket) -- except the
part in this rank's own slice of the bucket, which the reduce-scatter sums straight from the fresh gradient -- and
the sum happens in place (a reduce-scatter and an all-gather between the ranks' regions, no kernel copies).
``gradients_mean`` scales each contribution on its way in, as DDP divides before its all-reduce.

What it keeps from DDP: buckets in reverse parameter order, each summed as soon as its gradients are in, by a
background thread while the backward goes on with earlier layers (summed inline, every bucket was a rendezvous of
the ranks: measured, each rank then sat idle 20-28 ms per ResNet-50 step waiting for the other), ``no_sync()`` for
gradient accumulation, the gradients' memory layout (a channels-last weight gets a channels-last gradient). It acts only on a backward
that follows a forward through it (Model's steps), as DDP does; a parameter no rank used in a step gets a zero
gradient (DDP without ``find_unused_parameters`` stops with an error there). After each backward the ranks wait
until every one has gathered its sums: only then may a rank write its region again (``zero_grad``, the next
backward).
"""
from __future__ import annotations

import contextlib
import queue
import threading

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar import context as _context
from autopar.comm.host_memory import HostGroup
from autopar.errors import CommError, TrainingError


class HostReducer:
    """Calls ``module`` like DDP's wrapper does and sums the gradients of ``params`` over the host's ranks."""

    _autopar_step_wrapper = True  # the first-call hook of autopar.parallel.entry leaves it alone

    def __init__(self, module: torch.nn.Module, params: list[torch.nn.Parameter], host: HostGroup, *,
                 scale: float, bucket_numel: int):
        self.module, self.host, self.scale, self.params = module, host, scale, list(params)
        self._views: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._offset: dict[torch.nn.Parameter, int] = {}
        self._bucket: dict[torch.nn.Parameter, int] = {}
        self.buckets: list[tuple[int, int, list[torch.nn.Parameter]]] = []  # (start, stop, parameters)
        start = offset = 0
        members: list[torch.nn.Parameter] = []
        for p in reversed(params):  # the backward produces the last layers' gradients first
            n = p.numel()
            self._views[p], self._offset[p] = _view_like(host.region, offset, p), offset
            if members and offset + n - start > bucket_numel:
                self.buckets.append((start, offset, members))
                start, members = offset, []
            self._bucket[p] = len(self.buckets)
            members.append(p)
            offset += n
        if members:
            self.buckets.append((start, offset, members))
        self._owned = [host.owned(start, stop) for start, stop, _ in self.buckets]
        # per bucket, this backward: gradients whose part in this rank's slice is summed straight from them
        self._deferred: list[list[tuple[torch.nn.Parameter, int, torch.Tensor]]] = [[] for _ in self.buckets]
        self._sync = True
        self._armed = self._callback_queued = False
        self._work: queue.Queue[int] = queue.Queue()
        self._failure: BaseException | None = None
        self._worker: threading.Thread | None = None
        self._missing: list[int] = []
        self._ready: set[int] = set()
        self._next = 0
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_gradient)

    def __call__(self, *args, **kwargs):
        if self._failure is not None:  # the ranks are out of step: no later sum can be trusted
            raise CommError(f"the shared-memory gradient sum failed earlier: {self._failure}")
        self._armed = self._sync and torch.is_grad_enabled()
        if not self._armed:
            return self.module(*args, **kwargs)
        self._work.join()  # a backward that raised may have left buckets with the summing thread
        self._next, self._ready = 0, set()
        self._missing = [len(members) for _, _, members in self.buckets]
        self._deferred = [[] for _ in self.buckets]
        self._callback_queued = False
        output = self.module(*args, **kwargs)
        # The backward of this forward ends with _finish, queued when the backward reaches the outputs -- so on the
        # outermost backward (not a reentrant checkpoint's inner one), and on a rank whose backward reaches no
        # parameter (it still takes part in every sum: the others would wait for it)
        leaves, spec = tree_flatten(output)
        at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if at:
            sunk = _Sink.apply(self, *(leaves[i] for i in at))
            for i, t in zip(at, sunk if len(at) > 1 else (sunk,)):
                leaves[i] = t
            output = tree_unflatten(leaves, spec)
        return output

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate locally (in ``.grad``) until a backward outside the block sums them."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    # -- inside the backward ----------------------------------------------------------------------------------
    def _on_gradient(self, param: torch.nn.Parameter) -> None:
        # Model's backward only (the wrapper armed it, Model's managed step runs it): a plain loop's backward is
        # completed by the parameters' own hooks (parallel.grad_sync)
        if not self._armed or not _context.is_managed():
            return
        if id(param) in self._ready:  # its bucket may be summed already: a late contribution would be lost
            raise TrainingError(f"a parameter ({tuple(param.shape)}) received its gradient twice in one backward "
                                "(a parameter shared by reentrant checkpoints?): use "
                                "torch.utils.checkpoint(..., use_reentrant=False) in DATA_PARALLEL")
        self._ready.add(id(param))
        self._place(param)
        self._missing[self._bucket[param]] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._reduce(self._next)

    def _place(self, param: torch.nn.Parameter, defer: bool = True) -> None:
        """Put this rank's contribution (the gradient times the scale) in its region.

        The gradient the backward just produced is copied there except the part in this rank's own slice of the
        bucket: that part is summed straight from the gradient by the summing thread (a copy saved), which then
        makes ``.grad`` the region's view. A gradient already there (accumulated in place) is scaled there."""
        view, grad, s = self._views[param], param.grad, self.scale
        if grad is None:
            view.zero_()  # not used by this rank in this step: it adds nothing to the others' gradients
            if param.requires_grad:  # (a parameter frozen since keeps no gradient)
                param.grad = view
            return
        if grad.stride() != view.stride() and _dense(grad):  # the parameter changed layout (e.g. channels-last)
            self._views[param] = view = _view_like(self.host.region, self._offset[param], param)
        if grad.data_ptr() == view.data_ptr() and grad.stride() == view.stride():
            if s != 1.0:
                view.mul_(s)
            return
        if grad.stride() != view.stride() or not defer:
            torch.mul(grad, s, out=view)  # a copy, scaled on the way
            param.grad = view
            return
        start, n, b = self._offset[param], param.numel(), self._bucket[param]
        flat = grad.as_strided((n,), (1,))  # same dense layout as the view: memory order = region order
        lo, hi = self._owned[b]
        lo, hi = max(lo, start), min(hi, start + n)
        region = self.host.region
        for a, z in ((start, lo), (hi, start + n)) if hi > lo else ((start, start + n),):
            if z > a:
                torch.mul(flat[a - start:z - start], s, out=region[a:z])  # a copy, scaled on the way
        if hi > lo:
            self._deferred[b].append((param, lo, flat[lo - start:hi - start]))
        else:
            param.grad = view

    def _reduce(self, index: int) -> None:
        """Hand bucket ``index`` to the summing thread (buckets are summed in index order on every rank)."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._sum_buckets, name="autopar-host-reducer", daemon=True)
            self._worker.start()
        self._work.put(index)
        self._next = index + 1

    def _sum_buckets(self) -> None:
        with torch.no_grad():
            while True:
                index = self._work.get()
                try:
                    deferred, self._deferred[index] = self._deferred[index], []
                    if self._failure is None:
                        start, stop, _ = self.buckets[index]
                        self.host.all_reduce_range(start, stop, [(at, values) for _, at, values in deferred],
                                                   self.scale)
                        for param, _, _ in deferred:  # the backward is done with it: no other thread touches it
                            param.grad = self._views[param]
                except BaseException as e:  # noqa: BLE001 -- raised again in the training thread
                    self._failure = e
                finally:
                    self._work.task_done()

    def _finish(self) -> None:
        try:
            with torch.no_grad():
                for index in range(self._next, len(self.buckets)):
                    for p in self.buckets[index][2]:
                        if id(p) not in self._ready:
                            self._place(p, defer=False)
                    self._reduce(index)
            self._work.join()
            if self._failure is not None:
                raise self._failure
            self.host.settle()
        finally:
            self._armed = False


class _Sink(torch.autograd.Function):
    """Identity on the wrapper's outputs whose backward queues the reducer's end-of-backward (DDP's ``_DDPSink``)."""

    @staticmethod
    def forward(ctx, reducer, *outputs):
        ctx.reducer = reducer
        views = tuple(t.view_as(t) for t in outputs)
        return views if len(views) > 1 else views[0]

    @staticmethod
    def backward(ctx, *grads):
        reducer = ctx.reducer
        if reducer._armed and not reducer._callback_queued and _context.is_managed():
            reducer._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(reducer._finish)
        return (None, *grads)


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)


def _view_like(region: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """A view of ``region[offset:offset + numel]`` shaped and strided as autograd lays out ``param``'s gradient
    (dense tensors keep their memory format: a channels-last weight's gradient is channels-last)."""
    strides = torch.empty_like(param, device="meta").stride()
    return region.as_strided(param.shape, strides, region.storage_offset() + offset)


__all__ = ["HostReducer"]
