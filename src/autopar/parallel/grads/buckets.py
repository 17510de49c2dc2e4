"""Replicated parameters' gradients summed over the ranks a bucket at a time while the backward goes on -- DDP's
reducer, driven from the autograd graph instead of a wrapper's forward, so that every loop runs it.

Each parameter's ``.grad`` becomes a view of one flat *region* (DDP's ``gradient_as_bucket_view``): the backward's
gradient is copied there once (scaled by ``gradients_mean`` on the way, as DDP divides before its all-reduce), and
each bucket -- parameters in reverse order, 25 MB by default -- is summed as soon as its gradients are in, by a
*transport*:

- :class:`HostTransport`: every rank on this CPU host -- the region lives in shared memory and is summed there
  (:class:`~autopar.comm.host_memory.HostGroup`, on a background thread); the part of a bucket this rank sums itself
  is read straight from the fresh gradient, a copy saved;
- :class:`GroupTransport`: anywhere else (GPUs on NCCL, several hosts on gloo) -- an asynchronous all-reduce of the
  bucket on the process group, waited for at the end of the backward.

Driven by the graph: a hook on each parameter sees its gradient before it is accumulated, another after; the end of
the backward is a callback queued by an identity node on the network's outputs (DDP's ``_DDPSink``: it runs first in
the backward, so it belongs to the outermost backward even when a reentrant checkpoint runs inner ones) or, when the
backward did not come through those outputs (a sub-module called directly), by the first gradient. So a plain torch
loop, ``TrainOneStepCell`` and ``Model.train`` share one engine, one speed and one set of numbers.

Exact in what torch loops do: several backwards before a step accumulate as one process would -- the part of
``.grad`` already summed is kept apart and added back after the next sum, instead of being summed again -- and
inside :meth:`BucketReducer.no_sync` they accumulate locally until a backward outside sums them (DDP's rule). A
parameter some rank did not use in a backward gets the others' sum; one no rank used keeps no gradient, as in one
process (a flag per parameter travels in the last bucket). Gradients that ``torch.autograd.grad`` returns (no
``.grad``) are summed before they are returned.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import weakref
from typing import Sequence

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar import context as _context
from autopar.comm.host_memory import HostGroup
from autopar.errors import CommError, TrainingError
from autopar.parallel.grads.engine import accumulates, accumulator, claim, release, returns_deferred, unowned
from autopar.parallel.grads.transports import GroupTransport, HostTransport, reduce_now
from autopar.parallel.memory_id import same_memory


class BucketReducer:
    """Sums the gradients of ``params`` (one dtype, one device) over the ranks through ``transport``; ``scale``
    multiplies each rank's contribution (``1 / world`` for ``gradients_mean``)."""

    name = "bucketed all-reduce"
    # gradients returned under returned_later are this rank's plain local sums: several may be added up and
    # completed once (MindSpore's gradient accumulation reduces once per k mini-steps, common/accumulation.py)
    local_returns = True

    def __init__(self, params: Sequence[torch.nn.Parameter], transport, layout: "BucketLayout", scale: float,
                 group=None):
        self.params, self.transport, self.layout, self.scale, self.group = list(params), transport, layout, scale, group
        self.region = transport.region
        self._views = {id(p): _view_like(self.region, layout.offset[id(p)], p) for p in self.params}
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._owned = [transport.owned(start, stop) for start, stop, _ in layout.buckets]
        self._sync = True
        self._active = self._queued = False
        self._failure: BaseException | None = None
        self._ready: set[int] = set()
        self._missing: list[int] = []
        self._next = 0
        self._deferred: list[list] = [[] for _ in layout.buckets]
        self._carry: dict[int, torch.Tensor] = {}  # the part of .grad summed by an earlier backward, kept apart
        self._produced: dict[int, torch.Tensor] = {}  # the summed .grad this engine left
        self._handles: list = []
        self._watched: weakref.WeakSet = weakref.WeakSet()
        for p in self.params:
            ref, node = weakref.ref(p), accumulator(p)
            self._handles.append(p.register_hook(lambda g, ref=ref, node=node: self._before(ref(), node, g)))
            self._handles.append(p.register_post_accumulate_grad_hook(self._after))

    @property
    def transport_name(self) -> str:
        return self.transport.name

    # -- the network's outputs: where the end of the backward is queued -----------------------------------------
    def watch(self, root: torch.nn.Module) -> None:
        """The end of a backward through ``root``'s outputs is queued there (where it is most robust). The hook
        holds the reducer weakly and acts only on modules it watches: ``copy.deepcopy`` of the network (an EMA
        copy, an evaluation copy) copies the hook, not the reducer, and the copy trains on its own."""
        self._watched.add(root)
        self._handles.append(root.register_forward_hook(functools.partial(_sink_hook, weakref.ref(self))))

    def watch_once(self, module: torch.nn.Module) -> None:
        if module not in self._watched:
            self.watch(module)

    def _sink_outputs(self, module, args, output):
        if not (self._sync and torch.is_grad_enabled()) or self._failure is not None:
            return None
        leaves, spec = tree_flatten(output)
        at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not at:
            return None
        sunk = _Sink.apply(self, *(leaves[i] for i in at))
        for i, t in zip(at, sunk if len(at) > 1 else (sunk,)):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate locally (in ``.grad``) until a backward outside the block sums them."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    # -- inside the backward ------------------------------------------------------------------------------------
    def _begin(self) -> None:
        """The first event of a backward that sums: arm, and queue the end of it."""
        if self._active or not self._sync:
            return
        if self._failure is not None:  # the ranks are out of step: no later sum can be trusted
            raise CommError(f"the gradient sum failed earlier: {self._failure}")
        self.transport.drain()
        self._active = True
        self._ready = set()
        self._missing = [len(members) for _, _, members in self.layout.buckets]
        self._deferred = [[] for _ in self.layout.buckets]
        self._next = 0
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _before(self, p: torch.nn.Parameter | None, node, g: torch.Tensor) -> torch.Tensor:
        """Tensor hook: this backward's gradient of ``p``, before it is accumulated."""
        if p is None:
            return g
        if not accumulates(node):  # torch.autograd.grad returns it: complete it now (or, deferred, all at once)
            return g if returns_deferred() else self._complete_one(g)
        self._keep_summed_apart(p)
        self._begin()
        return g

    def _keep_summed_apart(self, p: torch.nn.Parameter) -> None:
        """``.grad`` still holds what an earlier backward summed -- the same on every rank, whatever the loop did to
        it since (zeroed, clipped): keep it out of this sum and add it back after, instead of summing it again."""
        produced = self._produced.pop(id(p), None)
        if produced is not None and p.grad is produced:
            self._carry[id(p)] = p.grad.clone()  # the region is overwritten by this backward's sum
            p.grad = None

    def _after(self, p: torch.nn.Parameter) -> None:
        """Post-accumulate hook: ``p.grad`` holds this backward's gradient (plus any local accumulation)."""
        if not self._active:
            return
        if id(p) in self._ready:  # its bucket may be summed already: a late contribution would be lost
            raise TrainingError(f"a parameter ({tuple(p.shape)}) received its gradient twice in one backward "
                                "(a parameter shared by reentrant checkpoints?): use "
                                "torch.utils.checkpoint(..., use_reentrant=False) in DATA_PARALLEL")
        self._ready.add(id(p))
        self._place(p, defer=True)
        self._missing[self.layout.bucket[id(p)]] -= 1
        while self._next < len(self.layout.buckets) and self._missing[self._next] == 0:
            self._reduce(self._next)

    def _place(self, p: torch.nn.Parameter, defer: bool) -> None:
        """Put this rank's contribution (``p.grad`` times the scale) in its region and raise its flag.

        The part of it in this rank's own slice of the bucket is, where the transport can, summed straight from the
        gradient (a copy saved); ``.grad`` becomes the region's view once its bucket is summed."""
        view, grad, s = self._views[id(p)], p.grad, self.scale
        flag = self.layout.flag_offset + self._index[id(p)]
        self.region[flag] = 0.0 if grad is None else 1.0
        if grad is None:
            view.zero_()  # adds nothing to the others' gradients
            return
        if grad.stride() != view.stride() and _dense(grad):  # the parameter changed layout (e.g. channels-last)
            self._views[id(p)] = view = _view_like(self.region, self.layout.offset[id(p)], p)
        if same_memory(grad, view) and grad.stride() == view.stride():
            if s != 1.0:
                view.mul_(s)  # accumulated in place, in the region
            return
        start, n, b = self.layout.offset[id(p)], p.numel(), self.layout.bucket[id(p)]
        lo, hi = self._owned[b]
        lo, hi = max(lo, start), min(hi, start + n)
        if grad.stride() != view.stride() or not defer or hi <= lo:
            torch.mul(grad, s, out=view)  # a copy, scaled on the way
            p.grad = view
            return
        flat = grad.as_strided((n,), (1,))  # same dense layout as the view: memory order = region order
        for a, z in ((start, lo), (hi, start + n)):
            if z > a:
                torch.mul(flat[a - start:z - start], s, out=self.region[a:z])
        self._deferred[b].append((p, lo, flat[lo - start:hi - start]))

    def _reduce(self, index: int) -> None:
        start, stop, _ = self.layout.buckets[index]
        deferred = self._deferred[index]
        own = [(at, values) for _, at, values in deferred]
        views = self._views

        def done() -> None:  # the backward is done with these gradients: .grad becomes the summed view
            for param, _, _ in deferred:
                param.grad = views[id(param)]

        self.transport.reduce(start, stop, own, self.scale, done)
        self._next = index + 1

    def _finish(self) -> None:
        """The end of the backward: the buckets still open (parameters this rank did not reach) are summed, and
        every gradient is settled."""
        self._queued = False
        if not self._active:
            return
        unused = []
        try:
            with torch.no_grad():
                for index in range(self._next, len(self.layout.buckets)):
                    for p in self.layout.buckets[index][2]:
                        if id(p) not in self._ready:
                            self._keep_summed_apart(p)
                            self._place(p, defer=False)
                            unused.append(p)
                    self._reduce(index)
                self.transport.wait()
                self.transport.settle()
                self._settle(unused)
        except BaseException as e:
            self._failure = e
            raise
        finally:
            self._active = False

    def _settle(self, unused: list) -> None:
        if unused:  # did any rank use them? (the flags were summed with the last bucket)
            flags = self.region[self.layout.flag_offset:].tolist()
            for p in unused:
                if flags[self._index[id(p)]] > 0:
                    p.grad = self._views[id(p)]
                elif p.grad is not None and same_memory(p.grad, self._views[id(p)]):
                    p.grad = None  # used by no rank, as in one process: no gradient
        for key, kept in self._carry.items():
            p = self.params[self._index[key]]
            if p.grad is None:
                p.grad = kept
            else:
                p.grad.add_(kept)
        self._carry.clear()
        self._produced = {id(p): p.grad for p in self.params if p.grad is not None}

    # -- gradients that torch.autograd.grad returns ---------------------------------------------------------------
    def _complete_one(self, g: torch.Tensor) -> torch.Tensor:
        # never in place: autograd may hand the same tensor to several inputs (the gradient of an addition)
        g = g * self.scale if self.scale != 1.0 else g.clone()
        dist.all_reduce(g, group=self.group)
        return g

    def complete_returned(self, params, grads) -> list[torch.Tensor]:
        return reduce_now(list(grads), self.group, self.scale)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        release(self)


def _sink_hook(ref, module, args, output):
    reducer = ref()
    if reducer is None or module not in reducer._watched:
        return None
    return reducer._sink_outputs(module, args, output)


class _Sink(torch.autograd.Function):
    """Identity on the network's outputs whose backward begins the reducer's backward (DDP's ``_DDPSink``)."""

    @staticmethod
    def forward(ctx, reducer, *outputs):
        ctx.reducer = reducer
        views = tuple(t.view_as(t) for t in outputs)
        return views if len(views) > 1 else views[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.reducer._begin()
        return (None, *grads)


class BucketLayout:
    """Where each parameter's gradient lies in the region: reverse parameter order (the backward produces the last
    layers' first), buckets of at most ``bucket_numel`` elements (a larger parameter alone), then one flag per
    parameter, summed with the last bucket."""

    def __init__(self, params: Sequence[torch.nn.Parameter], bucket_numel: int):
        self.offset: dict[int, int] = {}
        self.bucket: dict[int, int] = {}
        self.buckets: list[tuple[int, int, list]] = []
        start = offset = 0
        members: list = []
        for p in reversed(params):
            n = p.numel()
            if members and offset + n - start > bucket_numel:
                self.buckets.append((start, offset, members))
                start, members = offset, []
            self.offset[id(p)], self.bucket[id(p)] = offset, len(self.buckets)
            members.append(p)
            offset += n
        self.flag_offset = offset
        self.numel = offset + len(params)
        if members or params:
            self.buckets.append((start, self.numel, members))
        self.signature = hashlib.sha1(f"{[tuple(p.shape) for p in params]}/{bucket_numel}".encode()).hexdigest()


def bucket_reducers(params: Sequence[torch.nn.Parameter], *, scale: float, bucket_mb: float, shared_memory: bool,
                    group=None) -> list[BucketReducer]:
    """Collective: reducers for the trainable ``params`` -- one per (dtype, device), through shared memory where
    every rank of ``group`` is on this CPU host and the gradients are float32 (all ranks decide together), else
    through the process group."""
    groups: dict[tuple, list] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    bucket_numel = max(1, int(bucket_mb * 2**20))
    out = []
    for (dtype, device), members in groups.items():
        mine = unowned(members)
        if not mine:
            continue
        layout = BucketLayout(mine, max(1, bucket_numel // _itemsize(dtype)))
        host = None
        if device.type == "cpu":  # every rank asks (a collective), willing or not
            willing = shared_memory and dtype == torch.float32 and all(p.layout == torch.strided for p in mine)
            host = HostGroup.create(layout.numel, group=group, willing=willing, signature=layout.signature)
        transport = HostTransport(host) if host is not None else GroupTransport(layout.numel, dtype, device, group)
        reducer = BucketReducer(mine, transport, layout, scale, group)
        claim(reducer, mine)
        out.append(reducer)
    return out


def data_parallel_reducers(params, world: int, ctx) -> list:
    """Collective: the bucketed reducers of DATA_PARALLEL's replicated ``params`` under ``ctx`` and the speed
    levers -- for the job's network, and for the copy the planner's data-parallel step is measured on."""
    from autopar.perf.tuning import current

    levers = current()
    fusion = _context.allreduce_bucket_mb()  # comm_fusion={"allreduce": {"mode": "size", "config": MB}}; 0: no fusion
    graph = _context.run_context().mode == _context.GRAPH_MODE
    return bucket_reducers(params, scale=1.0 / world if ctx.gradients_mean else 1.0,
                           bucket_mb=levers.bucket_mb if fusion is None else fusion,
                           shared_memory=levers.shared_memory and not graph)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)


def _view_like(region: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """A view of ``region[offset:offset + numel]`` shaped and strided as autograd lays out ``param``'s gradient
    (dense tensors keep their memory format: a channels-last weight's gradient is channels-last)."""
    strides = torch.empty_like(param, device="meta").stride()
    return region.as_strided(param.shape, strides, region.storage_offset() + offset)
