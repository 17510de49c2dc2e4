"""A plain MLP of ``nn.Linear`` + ReLU (the planner's wide-MLP case)."""
from __future__ import annotations

import torch


def mlp(width: int = 4096, layers: int = 4, in_features: int | None = None, out_features: int | None = None,
        seed: int | None = 0) -> torch.nn.Sequential:
    if seed is not None:
        torch.manual_seed(seed)
    sizes = [in_features or width] + [width] * (layers - 1) + [out_features or width]
    modules: list[torch.nn.Module] = []
    for i in range(layers):
        modules += [torch.nn.Linear(sizes[i], sizes[i + 1]), torch.nn.ReLU()]
    return torch.nn.Sequential(*modules[:-1])
