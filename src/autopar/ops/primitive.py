"""``Primitive``: the base of MindSpore-style operators (``ops.MatMul()``, ``ops.AllReduce()``, ...).

An operator is a ``torch.nn.Module``: it appears in ``named_modules()`` (so the parallel layer can find every
operator and its shard strategy), is callable in ``construct``, and holds no parameters itself. How an operator
*executes* under a parallel mode is not decided here: while a parallel network runs (or the planner traces one),
that layer runs it inside :func:`executing`, keeping imports flowing one way (parallel -> ops). Outside, an operator
computes locally, as in PyNative mode.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch

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

    def __init__(self) -> None:
        super().__init__()
        self.strategy: tuple[tuple[int, ...], ...] | None = None

    @property
    def name(self) -> str:
        return type(self).__name__

    def compute(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        executor = current_executor()
        if executor is not None:
            return executor(self, args, kwargs)
        return self.compute(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"strategy={self.strategy}" if self.strategy is not None else ""
