"""MindSpore's gradient-accumulation buffers (``accu_grads = self.weights.clone(prefix="accu_grads", init="zeros")``)
and the mini-step mirror that reads them.

MindSpore's parallel pass pairs each weight with its ``accu_grads.<name>`` clone when ``grad_accumulation_step > 1``:
in an accumulation step (the cell flagged ``accumulation=True``) the weight's gradient comes back as it is and the
user's code adds it into the clone; in the step that updates (``accumulation=False``) the gradient that comes back is
the weight's gradient *plus* its clone -- the sum of the k micro-batches -- and the user's code then zeroes the clone.
:func:`add_accumulated` is that mirror (``GradOperation`` calls it). Gradients here are complete when they come back
(reduced over the ranks in the backward), so the clones sum complete gradients: the sum is the same, the
communication happens once per micro-batch rather than once per k.

A clone made before the network's first call in a layout mode (SEMI_AUTO / AUTO) is a whole tensor, while its weight
becomes this rank's DTensor slice on that call: :func:`follow` then gives the clone a DTensor replacement of the same
layout (recorded in :mod:`autopar.common.replaced`, so every ``ParameterTuple`` holding it yields the replacement).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

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


def add_accumulated(weights: Sequence[torch.Tensor], grads: tuple, network: Any) -> tuple:
    """The mini-step mirror: in the updating step (``network`` not flagged ``accumulation``, and
    ``grad_accumulation_step > 1``) each weight's gradient plus its accumulation clone."""
    if not len(_clone) or getattr(network, "accumulation", False):
        return grads
    from autopar import context

    if context.auto_parallel_context().grad_accumulation_step <= 1:
        return grads
    clones = {id(resolve(w)): c for w, c in list(_clone.items())}
    out = []
    for w, g in zip(weights, grads):
        clone = clones.get(id(w))
        if clone is not None:
            accumulated = follow(clone)
            g = g + (accumulated.to(g.dtype) if accumulated.dtype != g.dtype else accumulated)
        out.append(g)
    return tuple(out)
