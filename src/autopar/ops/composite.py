"""MindSpore's composite operators for hand-written training steps: ``GradOperation``, ``HyperMap``,
``MultitypeFuncGraph``, ``partial`` and ``depend``.

``GradOperation`` is :func:`autopar.ops.grad.value_and_grad`'s engine (``torch.autograd.grad``) with MindSpore's
switches; ``HyperMap`` maps a function over sequences (MindSpore compiles it into the graph; here it is a loop);
``MultitypeFuncGraph`` picks the registered function whose type names ("Tensor", "Number", "Tuple", ...) match the
arguments; ``depend(value, expr)`` orders side effects in a graph and is ``value`` in eager execution.
"""
from __future__ import annotations

import contextlib
import functools
import numbers
from typing import Any, Callable

import torch

from autopar.common import grad_owners as owners
from autopar.common.accumulation import add_accumulated, mini_step
from autopar.common.replaced import resolve
from autopar.errors import TrainingError

partial = functools.partial


def depend(value: Any, expr: Any) -> Any:
    return value


class GradOperation:
    """``GradOperation(get_all=False, get_by_list=False, sens_param=False)(fn, weights)(*inputs[, sens])``."""

    def __init__(self, get_all: bool = False, get_by_list: bool = False, sens_param: bool = False):
        self.get_all, self.get_by_list, self.sens_param = get_all, get_by_list, sens_param

    def __call__(self, fn: Callable, weights: Any = None) -> Callable:
        if self.get_by_list and weights is None:
            raise TrainingError("GradOperation(get_by_list=True) needs the weights: grad(net, weights)")

        def grad_fn(*args: Any) -> Any:
            args = list(args)
            sens = args.pop() if self.sens_param else None
            inputs = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                      for a in args]
            with torch.enable_grad():
                out = fn(*inputs)
            wanted = [a for a in (inputs if self.get_all else inputs[:1]) if isinstance(a, torch.Tensor)
                      and a.requires_grad] if (self.get_all or not self.get_by_list) else []
            ws = [resolve(w) for w in weights] if self.get_by_list else []
            if isinstance(sens, torch.Tensor) and isinstance(out, torch.Tensor) and sens.shape != out.shape:
                # MindSpore takes a sensitivity of one element for a scalar loss ((1,) for ())
                sens = sens.reshape(out.shape) if sens.numel() == out.numel() else sens.expand(out.shape)
            kind, once = mini_step(ws, fn)  # MindSpore's gradient accumulation (accu_grads clones of ws)
            with owners.returned_later() if once else contextlib.nullcontext():
                grads = torch.autograd.grad(out, wanted + ws, grad_outputs=sens if sens is not None else
                                            torch.ones_like(out), allow_unused=True)
            grads = tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, wanted + ws))
            input_grads, weight_grads = grads[:len(wanted)], grads[len(wanted):]
            if kind == "update":  # the mini-step mirror: this step's gradient plus the accumulated ones
                weight_grads = add_accumulated(ws, weight_grads, fn)
                if once:  # reduced once, the k micro-batches' sum
                    weight_grads = tuple(owners.complete(ws, weight_grads))
            if self.get_by_list and self.get_all:
                return input_grads, weight_grads
            if self.get_by_list:
                return weight_grads
            return input_grads if self.get_all else input_grads[0]

        return grad_fn


_TYPE_NAMES = {"Tensor": torch.Tensor, "Number": numbers.Number, "Tuple": tuple, "List": list, "Bool": bool,
               "Int": int, "Float": float, "String": str, "Function": Callable}


class MultitypeFuncGraph:
    """``f = MultitypeFuncGraph("name")``; ``@f.register("Number", "Tensor") def _(a, b): ...``; ``f(a, b)``."""

    def __init__(self, name: str, read_value: bool = False):
        self.name = name
        self._entries: list[tuple[tuple, Callable]] = []

    def register(self, *type_names: str) -> Callable:
        types = tuple(_TYPE_NAMES.get(t, object) for t in type_names)

        def add(fn: Callable) -> Callable:
            self._entries.append((types, fn))
            return fn

        return add

    def __call__(self, *args: Any) -> Any:
        for types, fn in self._entries:
            if len(types) == len(args) and all(isinstance(a, t) for a, t in zip(args, types)):
                return fn(*args)
        got = ", ".join(type(a).__name__ for a in args)
        raise TrainingError(f"MultitypeFuncGraph {self.name!r}: no function registered for ({got})")


class HyperMap:
    """``HyperMap(fn=None)(fn?, *sequences)``: ``fn`` applied element-wise over the sequences (a tuple back)."""

    def __init__(self, ops: Callable | None = None, reverse: bool = False):
        self.ops = ops

    def __call__(self, *args: Any) -> Any:
        fn, seqs = (self.ops, args) if self.ops is not None else (args[0], args[1:])
        return _map(fn, seqs)


def _map(fn: Callable, seqs: tuple) -> Any:
    if seqs and isinstance(seqs[0], (tuple, list)):
        return tuple(_map(fn, items) for items in zip(*seqs))
    return fn(*seqs)


Map = HyperMap
