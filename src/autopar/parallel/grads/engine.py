"""The gradient seam: each trainable parameter of a parallelized network has exactly one engine that completes its
gradient, chosen once (:func:`autopar.parallel.api.attach`) from the parallel context.

Engines behind the seam:

- :class:`~autopar.parallel.grads.buckets.BucketReducer` -- replicated parameters (DATA_PARALLEL, HYBRID's ordinary
  ones): summed over the ranks a bucket at a time while the backward goes on, through shared memory when every rank
  is on this CPU host, else through the process group (gloo / NCCL);
- :class:`~autopar.parallel.grads.layouts.LayoutGrads` -- parameters laid out as DTensors and the replicated ones
  beside them (SEMI_AUTO / AUTO): each gradient redistributed to its parameter's placements inside the backward;
- :class:`~autopar.parallel.grads.layouts.LocalGrads` -- HYBRID's ``layerwise_parallel`` slices: the network's own
  collectives did the work, only ``gradients_mean`` is applied;
- :class:`~autopar.parallel.zero.fsdp.ShardedGrads` -- ZeRO: FSDP2's own reduce-scatter;
- a pipeline's replicas: :func:`~autopar.parallel.grads.buckets.reduce_now` over the stage's data-parallel group
  after the schedule ran.

Every engine is driven from the autograd graph (tensor hooks, post-accumulate hooks, a callback queued for the end
of the backward), never from "which loop is this": a plain torch loop, ``TrainOneStepCell``, ``value_and_grad`` and
``Model.train`` run the same engine and get the same numbers.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Protocol, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary


class GradientEngine(Protocol):
    """What every engine offers the training loops and the rest of autopar."""

    name: str

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backwards inside accumulate locally; the first backward outside completes the sum."""

    def complete_returned(self, params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor]
                          ) -> list[torch.Tensor]:
        """Gradients that ``torch.autograd.grad`` returned for ``params`` (not accumulated into ``.grad``) while
        :func:`returned_later` was on, completed now -- all together, as one collective where the engine can."""

    def close(self) -> None:
        """Remove every hook this engine put on parameters and modules."""


_owner: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> the engine that completes its gradient


def claim(engine: GradientEngine, params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters of ``params`` that ``engine`` now owns: those that require a gradient and have no owner yet (a
    parameter shared with a network parallelized before keeps its first owner)."""
    mine = []
    seen: set[int] = set()
    for p in params:
        if not p.requires_grad or id(p) in seen or p in _owner:
            continue
        seen.add(id(p))
        _owner[p] = engine
        mine.append(p)
    return mine


def unowned(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters of ``params`` an engine could claim now (each once, in order)."""
    out, seen = [], set()
    for p in params:
        if p.requires_grad and id(p) not in seen and p not in _owner:
            seen.add(id(p))
            out.append(p)
    return out


def release(engine: GradientEngine) -> None:
    for p in [p for p, e in _owner.items() if e is engine]:
        del _owner[p]


def owner_of(param: torch.Tensor) -> GradientEngine | None:
    return _owner.get(param)


# -- gradients returned by torch.autograd.grad (MindSpore's value_and_grad) ---------------------------------------
_defer_returns = 0


@contextlib.contextmanager
def returned_later() -> Iterator[None]:
    """Inside, gradients that ``torch.autograd.grad`` returns are handed back as each rank computed them; the caller
    completes them afterwards with :func:`complete` (one collective per engine instead of one per parameter)."""
    global _defer_returns
    _defer_returns += 1
    try:
        yield
    finally:
        _defer_returns -= 1


def returns_deferred() -> bool:
    return _defer_returns > 0


def complete(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Complete gradients returned under :func:`returned_later`: each parameter's by its engine (a parameter no
    engine owns -- an input, or a network that is not parallel -- keeps its gradient)."""
    out = list(grads)
    by_engine: dict[int, tuple[GradientEngine, list[int]]] = {}
    for i, p in enumerate(params):
        engine = _owner.get(p)
        if engine is not None and grads[i] is not None:
            by_engine.setdefault(id(engine), (engine, []))[1].append(i)
    for engine, idx in by_engine.values():
        done = engine.complete_returned([params[i] for i in idx], [grads[i] for i in idx])
        for i, g in zip(idx, done):
            out[i] = g
    return out


def accumulates(node) -> bool:
    """Inside a tensor hook of a leaf: will this backward accumulate into ``.grad`` (``backward()``), or return the
    gradient (``torch.autograd.grad``)?"""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # torch.autograd.grad: "not supported" -- nothing is accumulated
        return False


def accumulator(param: torch.Tensor):
    """The AccumulateGrad node of a leaf (what ``accumulates`` asks about)."""
    with torch.enable_grad():  # hooks run without grad mode: no graph, no node, otherwise
        return param.view_as(param).grad_fn.next_functions[0][0]
