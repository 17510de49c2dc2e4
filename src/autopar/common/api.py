"""``mindspore.jit`` / ``mindspore.lazy_inline`` (``mindspore.common.api``): graph-compilation decorators.

``@jit`` (also ``@jit(...)`` with any of MindSpore's options, and on a Cell's ``construct``) returns the function
unchanged: on the CPU it runs eagerly, operator by operator, exactly as written -- the same results MindSpore's
compiled graph gives, without the compile time. Whole-network compilation is ``set_context(mode=GRAPH_MODE)``
(``torch.compile`` on the network, see docs/performance.md); ``jit`` does not add a second way. ``@lazy_inline`` (a
compile-time hint on a Cell's ``__init__``) likewise returns the function as it is.
"""
from __future__ import annotations

from typing import Any, Callable


def jit(function: Callable | None = None, *args: Any, **kwargs: Any) -> Any:
    if function is None or not callable(function):
        return lambda fn: fn
    return function


def lazy_inline(fn: Callable | None = None, attrs: Any = None, policy: Any = None) -> Any:
    if fn is None:
        return lambda f: f
    return fn


ms_function = jit  # MindSpore 1.x's name
