"""Optimizers with MindSpore's names. ``Momentum`` is ``torch.optim.SGD`` with momentum: MindSpore's update
``v = momentum * v + grad; p -= lr * v`` is exactly torch's (dampening 0), so torch's fused/foreach kernels, its
state dict and every torch scheduler apply. Any torch optimizer works with ``Model`` too."""
from __future__ import annotations

from typing import Any, Iterable

import torch


def _param_groups(params: Iterable[Any]) -> list:
    """MindSpore accepts ``filter(...)`` iterators and group dicts with ``order_params``; torch wants lists."""
    items = list(params)
    groups = []
    for item in items:
        if isinstance(item, dict):
            if "order_params" in item:
                continue  # MindSpore ordering hint; torch keeps group order
            group = dict(item)
            if "lr" not in group and "learning_rate" in group:
                group["lr"] = group.pop("learning_rate")
            group["params"] = list(group["params"])
            groups.append(group)
    return groups or items


class Momentum(torch.optim.SGD):
    def __init__(self, params: Iterable[Any], learning_rate: float, momentum: float, weight_decay: float = 0.0,
                 loss_scale: float = 1.0, use_nesterov: bool = False, foreach: bool | None = None):
        if loss_scale != 1.0:
            raise ValueError("Momentum(loss_scale != 1) is not supported; use amp_level with Model instead")
        super().__init__(_param_groups(params), lr=float(learning_rate), momentum=float(momentum),
                         weight_decay=float(weight_decay), nesterov=use_nesterov, foreach=foreach)

    @property
    def learning_rate(self) -> float:
        return self.param_groups[0]["lr"]


class SGD(torch.optim.SGD):
    def __init__(self, params: Iterable[Any], learning_rate: float = 0.1, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, loss_scale: float = 1.0):
        super().__init__(_param_groups(params), lr=float(learning_rate), momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov)


class Adam(torch.optim.Adam):
    def __init__(self, params: Iterable[Any], learning_rate: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 0.0, **_: Any):
        super().__init__(_param_groups(params), lr=float(learning_rate), betas=(beta1, beta2), eps=eps,
                         weight_decay=weight_decay)
