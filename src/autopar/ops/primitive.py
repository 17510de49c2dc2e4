"""``Primitive``: the base of MindSpore-style operators (``ops.MatMul()``, ``ops.AllReduce()``, ...).

An operator is a ``torch.nn.Module``: it appears in ``named_modules()`` (so the parallel layer can find every
operator and its shard strategy), is callable in ``construct``, and holds no parameters itself. How an operator
*executes* under a parallel mode is not decided here: the parallel layer installs an executor (see
:func:`set_executor`), keeping imports flowing one way (parallel -> ops).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

# The parallel layer replaces this with its sharded executor; the default runs the op locally.
_executor: Callable[["Primitive", tuple, dict], Any] | None = None


def set_executor(executor: Callable[["Primitive", tuple, dict], Any] | None) -> None:
    global _executor
    _executor = executor


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
        if _executor is not None:
            return _executor(self, args, kwargs)
        return self.compute(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"strategy={self.strategy}" if self.strategy is not None else ""
