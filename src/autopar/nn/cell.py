"""``Cell``: MindSpore's network base class as a ``torch.nn.Module`` whose ``forward`` calls ``construct``."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch


_managed = threading.local()


@contextlib.contextmanager
def managed():
    """Calls made by autopar itself (a training step, the planner's trace): Cells inside are already taken care
    of and must not parallelize themselves on the side."""
    depth = getattr(_managed, "depth", 0)
    _managed.depth = depth + 1
    try:
        yield
    finally:
        _managed.depth = depth


def _needs_layouts(cell: torch.nn.Module) -> bool:
    if getattr(_managed, "depth", 0):
        return False
    from autopar import context
    from autopar.comm import management

    mode = context.auto_parallel_context().parallel_mode
    if mode not in (context.ParallelMode.SEMI_AUTO_PARALLEL, context.ParallelMode.AUTO_PARALLEL):
        return False
    if not management.is_initialized():
        return False
    from autopar.parallel.api import has_strategies
    from autopar.parallel.semi_auto.runtime import active_runtime

    if active_runtime() is not None:
        return False
    return mode is context.ParallelMode.AUTO_PARALLEL or has_strategies(cell)


class Cell(torch.nn.Module):
    def __init__(self, auto_prefix: bool = True, flags: Any = None) -> None:
        super().__init__()

    def construct(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must define construct()")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.construct(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # MindSpore compiles a Cell for the parallel context when it is first called; autopar parallelizes it.
        if "_autopar_runtime" not in self.__dict__ and _needs_layouts(self):
            from autopar.parallel.api import parallelize

            parallelize(self, sample=list(args))
        return super().__call__(*args, **kwargs)

    # MindSpore spellings of torch.nn.Module methods ---------------------------------------------------------
    def get_parameters(self, expand: bool = True) -> Iterator[torch.nn.Parameter]:
        return self.parameters(recurse=expand)

    def trainable_params(self, recurse: bool = True) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters(recurse) if p.requires_grad]

    def untrainable_params(self, recurse: bool = True) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters(recurse) if not p.requires_grad]

    def parameters_dict(self, recurse: bool = True) -> dict[str, torch.nn.Parameter]:
        return dict(self.named_parameters(recurse=recurse))

    def parameters_and_names(self, name_prefix: str = "", expand: bool = True):
        return self.named_parameters(prefix=name_prefix, recurse=expand)

    def cells_and_names(self):
        return self.named_modules()

    def cells(self):
        return self.children()

    def set_train(self, mode: bool = True) -> "Cell":
        return self.train(mode)

    def set_grad(self, requires_grad: bool = True) -> "Cell":
        return self
