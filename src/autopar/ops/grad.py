"""MindSpore's functional differentiation: ``value_and_grad`` and ``grad`` (``autopar.value_and_grad``,
``autopar.ops.value_and_grad``), on ``torch.autograd.grad``.

In a parallel mode the gradients come back complete -- equal to one process's on the global batch: each parameter's
gradient engine (``autopar.parallel.grads``) completes them, one collective for all of them where it can; no
``DistributedGradReducer`` is needed (autopar's is the identity). ``weights`` may be given before the network
first ran (``opt.parameters`` right after building it): they are looked up again after the forward, so a parameter
that a layout mode replaced by its slice is differentiated as the slice.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from autopar.common import grad_owners as owners
from autopar.common.replaced import resolve
from autopar.errors import TrainingError, user_stacklevel


def _positions(grad_position: Any) -> tuple[int, ...]:
    if grad_position is None:
        return ()
    return (grad_position,) if isinstance(grad_position, int) else tuple(grad_position)


def _differentiate(loss, targets: list, ws: list, inputs: int) -> tuple:
    """The gradients of ``loss`` for ``targets`` (``inputs`` network inputs, then the weights ``ws``), complete:

    - a pipeline's step ran forward and backward itself (MindSpore's functional pipeline: ``PipelineCell`` inside
      ``value_and_grad``): the weights' gradients are in ``.grad`` -- taken from there, ``.grad`` left empty;
    - weights whose gradient only a backward produces (ZeRO: FSDP2 reduce-scatters into each shard's ``.grad``):
      a backward, the gradients taken from ``.grad``, whatever ``.grad`` held before put back;
    - otherwise ``torch.autograd.grad``, each weight's engine completing what it returned in one collective.
    """
    if owners.backward_done(loss):
        if inputs:
            raise TrainingError("value_and_grad: a pipeline's step gives gradients of the weights only "
                                "(grad_position=None)")
        grads = tuple(w.grad if w.grad is not None else torch.zeros_like(w) for w in ws)  # other stages': zeros
        for w in ws:
            w.grad = None
        return grads
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        raise TrainingError("value_and_grad: the value does not depend on anything that requires a gradient")
    if any(owners.needs_backward(w) for w in ws):
        kept = [t.grad for t in targets]
        for t in targets:
            t.grad = None
        loss.backward(torch.ones_like(loss))
        grads = tuple(t.grad for t in targets)
        for t, g in zip(targets, kept):
            t.grad = g
        return grads
    with owners.returned_later():
        grads = torch.autograd.grad(loss, targets, grad_outputs=torch.ones_like(loss), allow_unused=True)
    return tuple(owners.complete(targets, grads))


def value_and_grad(fn: Callable, grad_position: Any = 0, weights: Any = None, has_aux: bool = False,
                   return_ids: bool = False) -> Callable:
    """``fn(*inputs) -> loss`` (or ``(loss, aux...)`` with ``has_aux``) becomes ``f(*inputs) -> (value, grads)``:
    grads of the inputs at ``grad_position``, of ``weights``, or ``(inputs' grads, weights' grads)`` for both."""
    if return_ids:
        raise TrainingError("value_and_grad(return_ids=True) is not supported by autopar")
    positions = _positions(grad_position)
    if not positions and weights is None:
        raise TrainingError("value_and_grad: grad_position=None needs weights (e.g. optimizer.parameters)")
    single_weight = isinstance(weights, torch.Tensor)

    def wrapper(*args: Any) -> tuple:
        args = list(args)
        for i in positions:
            if i >= len(args) or not isinstance(args[i], torch.Tensor):
                raise TrainingError(f"value_and_grad: grad_position {i} is not a tensor input")
            args[i] = args[i].detach().requires_grad_(True)
        with torch.enable_grad():
            out = fn(*args)
        loss = out[0] if isinstance(out, (tuple, list)) else out
        if not has_aux and isinstance(out, (tuple, list)) and len(out) > 1:
            raise TrainingError("value_and_grad: fn returned several values; pass has_aux=True to differentiate the "
                                "first only")
        ws = [] if weights is None else [resolve(w) for w in ([weights] if single_weight else list(weights))]
        targets = [args[i] for i in positions] + ws
        grads = _differentiate(loss, targets, ws, len(positions))
        unused = [k for k, g in enumerate(grads[len(positions):]) if g is None]
        if ws and len(unused) == len(ws):
            raise TrainingError("value_and_grad: none of the weights took part in the value -- are they the "
                                "network's parameters (e.g. optimizer.parameters of an optimizer over the network)?")
        if unused:
            warnings.warn(f"autopar: value_and_grad: {len(unused)} of {len(ws)} weights did not take part in the "
                          f"value; their gradients are zeros", stacklevel=user_stacklevel())
        grads = tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, targets))
        input_grads, weight_grads = grads[:len(positions)], grads[len(positions):]
        if isinstance(grad_position, int):
            input_grads = input_grads[0]
        if single_weight:
            weight_grads = weight_grads[0]
        if not positions:
            result = weight_grads
        elif weights is None:
            result = input_grads
        else:
            result = (input_grads, weight_grads)
        value = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
        return value, result

    return wrapper


def grad(fn: Callable, grad_position: Any = 0, weights: Any = None, has_aux: bool = False,
         return_ids: bool = False) -> Callable:
    """MindSpore's ``grad``: ``value_and_grad`` without the value (with ``has_aux``: ``(grads, aux)``)."""
    inner = value_and_grad(fn, grad_position, weights, has_aux, return_ids)

    def wrapper(*args: Any) -> Any:
        value, grads = inner(*args)
        if has_aux:
            return grads, tuple(value[1:])
        return grads

    return wrapper
