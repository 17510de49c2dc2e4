"""MindSpore's gradient-accumulation buffers (``accu_grads = self.weights.clone(prefix="accu_grads", init="zeros")``)
and the mini-step mirror that reads them.

MindSpore's parallel pass pairs each weight with its ``accu_grads.<name>`` clone when ``grad_accumulation_step > 1``:
in an accumulation step (the cell flagged ``accumulation=True``) the weight's gradient comes back as it is and the
user's code adds it into the clone; in the step that updates (``accumulation=False``) the gradient that comes back is
the weight's gradient *plus* its clone -- the sum of the k micro-batches -- and the user's code then zeroes the clone.
:func:`add_accumulated` is that mirror (``GradOperation`` calls it). Gradients here are complete when they come back
(reduced over the ranks in the backward), so the clones sum complete gradients -- except in data parallel, where
the accumulation steps return local gradients and the updating step all-reduces the sum once (:func:`mini_step`).

A clone made before the network's first call in a layout mode (SEMI_AUTO / AUTO) is a whole tensor, while its weight
becomes this rank's DTensor slice on that call: :func:`follow` then gives the clone a DTensor replacement of the same
layout (recorded in :mod:`autopar.common.replaced`, so every ``ParameterTuple`` holding it yields the replacement).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from autopar.common import grad_owners as owners
from autopar.common.replaced import record, resolve

_source: WeakIdKeyDictionary = WeakIdKeyDictionary()  # accumulation clone -> the weight it accumulates for
_clone: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight (as cloned) -> its accumulation clone


def register(clone: torch.Tensor, weight: torch.Tensor) -> None:
    _source[clone] = weight
    _clone[weight] = clone


def follow(param: torch.Tensor) -> torch.Tensor:
    """``param`` as it trains now; an accumulation clone whose weight was laid out as a DTensor gets (once) a zero
    DTensor replacement of that layout."""
    weight = _source.get(param)
    if weight is not None:
        now, current = resolve(weight), resolve(param)
        if hasattr(now, "placements") and not hasattr(current, "placements"):
            replacement = torch.nn.Parameter(torch.zeros_like(now.detach(), dtype=current.dtype), requires_grad=False)
            replacement.__dict__["_ms_name"] = getattr(param, "name", None)
            record(param, replacement)
    return resolve(param)


def _clones_of(weights: Sequence[torch.Tensor]) -> list:
    """Each weight's accumulation clone (None where it has none), only while ``grad_accumulation_step > 1``."""
    if not len(_clone):
        return [None] * len(weights)
    from autopar import context

    if context.auto_parallel_context().grad_accumulation_step <= 1:
        return [None] * len(weights)
    clones = {id(resolve(w)): c for w, c in list(_clone.items())}
    return [clones.get(id(w)) for w in weights]


def mini_step(weights: Sequence[torch.Tensor], network: Any) -> tuple[str | None, bool]:
    """``(kind, reduce_once)`` of a gradient computation of ``weights`` through ``network``: kind ``"accumulate"``
    (``network`` flagged ``accumulation``), ``"update"`` or None (no accumulation clones: nothing to do).
    ``reduce_once``: every weight's gradient engine returns plain local sums (data parallel's all-reduce), so the
    accumulation steps keep them local and the updating step all-reduces the k micro-batches' sum once -- as
    MindSpore's mirror operator does; otherwise each mini-step's gradient comes back complete (the same sum)."""
    if not any(c is not None for c in _clones_of(weights)):
        return None, False
    kind = "accumulate" if getattr(network, "accumulation", False) else "update"
    engines = [owners.owner_of(w) for w in weights]
    once = any(e is not None for e in engines) and all(e is None or getattr(e, "local_returns", False)
                                                       for e in engines)
    return kind, once


def add_accumulated(weights: Sequence[torch.Tensor], grads: tuple, network: Any) -> tuple:
    """The mini-step mirror: in the updating step (``network`` not flagged ``accumulation``, and
    ``grad_accumulation_step > 1``) each weight's gradient plus its accumulation clone."""
    if getattr(network, "accumulation", False):
        return grads
    out = []
    for g, clone in zip(grads, _clones_of(weights)):
        if clone is not None:
            accumulated = follow(clone)
            g = g + (accumulated.to(g.dtype) if accumulated.dtype != g.dtype else accumulated)
        out.append(g)
    return tuple(out)
