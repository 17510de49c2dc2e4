"""Who completes each parameter's gradient -- the registry behind the gradient seam (the engines themselves live in
:mod:`autopar.parallel.grads`). It sits low in the house so that ``value_and_grad`` (``autopar.ops``) can ask a
parameter's engine to complete gradients that ``torch.autograd.grad`` returned, and learn that a pipeline's step ran
the backward itself, without importing the parallel runtime."""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterable, Iterator, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

_owner: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> the engine that completes its gradient


def claim(engine, params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
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


def release(engine) -> None:
    for p in [p for p, e in _owner.items() if e is engine]:
        del _owner[p]


def owner_of(param: torch.Tensor):
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
    by_engine: dict[int, tuple[object, list[int]]] = {}
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


# -- losses whose backward already ran (a pipeline's step: forward and backward over the micro-batches) -------------
_backward_done: weakref.WeakSet = weakref.WeakSet()


def mark_backward_done(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` comes from a step that ran its own backward: its gradients are in the parameters' ``.grad``."""
    _backward_done.add(loss)
    return loss


def backward_done(loss) -> bool:
    return isinstance(loss, torch.Tensor) and loss in _backward_done


def needs_backward(param: torch.Tensor) -> bool:
    """Is ``param``'s gradient produced only by a backward that accumulates (ZeRO: FSDP2 reduce-scatters into the
    shard's ``.grad``; ``torch.autograd.grad`` never sees the shard)?"""
    return bool(getattr(_owner.get(param), "needs_backward", False))
