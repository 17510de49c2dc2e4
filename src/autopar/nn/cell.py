"""``Cell``: MindSpore's network base class as a ``torch.nn.Module`` whose ``forward`` calls ``construct``.

MindSpore compiles a Cell for the parallel context on its first call; autopar parallelizes any module -- Cell or
plain torch -- on its first call (``autopar.parallel.entry``), so a Cell needs nothing of its own for that."""
from __future__ import annotations

from typing import Any, Iterator

import torch


class Cell(torch.nn.Module):
    def __init__(self, auto_prefix: bool = True, flags: Any = None) -> None:
        super().__init__()

    def construct(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must define construct()")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.construct(*args, **kwargs)

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
