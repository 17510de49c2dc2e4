"""``Primitive``: the base of MindSpore-style operators (``ops.MatMul()``, ``ops.AllReduce()``, ...).

An operator is a ``torch.nn.Module``: it appears in ``named_modules()`` (so the parallel layer can find every
operator and its shard strategy), is callable in ``construct``, and holds no parameters itself. How an operator
*executes* under a parallel mode is not decided here: while a parallel network runs (or the planner traces one),
that layer runs it inside :func:`executing`, keeping imports flowing one way (parallel -> ops). Outside, an operator
computes locally, as in PyNative mode. Operators marked ``local`` (shape and array helpers such as ``Flatten``,
``Print``) never go through the executor: they run on whatever tensors they get, DTensors included (torch's DTensor
dispatch keeps the layout).

``op.recompute()`` (MindSpore's ``Primitive.recompute``) keeps only the operator's inputs for the backward and
computes it again there (``torch.utils.checkpoint``, ``use_reentrant=False``): the same result and gradients.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

_local = threading.local()  # the executors in force on this thread, innermost last


@contextlib.contextmanager
def executing(executor: Callable[["Primitive", tuple, dict], Any]) -> Iterator[None]:
    """Operators called inside run through ``executor(op, args, kwargs)``."""
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(executor)
    try:
        yield
    finally:
        stack.pop()


def current_executor() -> Callable[["Primitive", tuple, dict], Any] | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


class Primitive(torch.nn.Module):
    """A stateless operator. Subclasses implement :meth:`compute` (plain torch on whatever tensors they get)."""

    local = False  # True: never through the parallel executor (see the module docstring)

    def __init__(self) -> None:
        super().__init__()
        self.strategy: tuple[tuple[int, ...], ...] | None = None
        self.recompute_mode = False
        self.attrs: dict[str, Any] = {}

    def recompute(self, mode: bool = True) -> "Primitive":
        self.recompute_mode = bool(mode)
        return self

    def add_prim_attr(self, name: str, value: Any) -> "Primitive":
        """MindSpore's operator attributes (compiler hints): kept in ``attrs``, read by nothing here."""
        self.attrs[name] = value
        return self

    def set_device(self, device: str) -> "Primitive":
        """MindSpore's heterogeneous placement (an operator on the host CPU): every operator here runs where its
        inputs are, so it is accepted and warned about once."""
        from autopar.errors import warn_once

        warn_once("Primitive.set_device", f"{self.name}.set_device({device!r}) is accepted: operators run on the "
                  f"device of their inputs")
        return self

    @property
    def name(self) -> str:
        return type(self).__name__

    def compute(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("recompute_mode") and torch.is_grad_enabled():
            return checkpoint(self._run, *args, use_reentrant=False, **kwargs)
        return self._run(*args, **kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        executor = current_executor()
        if executor is not None and not self.local:
            return executor(self, args, kwargs)
        return self.compute(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"strategy={self.strategy}" if self.strategy is not None else ""
