"""Optimizers with MindSpore's names. ``Momentum`` is ``torch.optim.SGD`` with momentum: MindSpore's update
``v = momentum * v + grad; p -= lr * v`` is exactly torch's (dampening 0), so torch's fused/foreach kernels, its
state dict and every torch scheduler apply. Any torch optimizer works with ``Model`` too.

MindSpore's functional loop also works: ``opt.parameters`` are the weights to differentiate
(``value_and_grad(net_with_loss, None, opt.parameters)``) and ``opt(grads)`` applies gradients given in that order.
Both follow a parameter that a parallel mode replaced by its slice (:mod:`autopar.common.replaced`)."""
from __future__ import annotations

from typing import Any, Iterable

import torch

from autopar.common.replaced import remap_optimizer, resolve
from autopar.errors import TrainingError


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


def _parameters(self: torch.optim.Optimizer) -> tuple:
    """MindSpore's ``optimizer.parameters``: every parameter the optimizer updates, in its groups' order."""
    return tuple(resolve(p) for group in self.param_groups for p in group["params"])


def _apply_gradients(self: torch.optim.Optimizer, gradients: Any) -> bool:
    """MindSpore's ``optimizer(grads)``: one update with ``gradients`` given in ``optimizer.parameters`` order."""
    remap_optimizer(self)
    params = [p for group in self.param_groups for p in group["params"]]
    grads = list(gradients)
    if len(grads) != len(params):
        raise TrainingError(f"{type(self).__name__}(grads): got {len(grads)} gradients for {len(params)} parameters "
                            f"(differentiate with respect to optimizer.parameters)")
    for p, g in zip(params, grads):
        p.grad = g
    self.step()
    for p in params:
        p.grad = None
    return True


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


class AdamWeightDecay(torch.optim.AdamW):
    """MindSpore's AdamWeightDecay: Adam with decoupled weight decay, i.e. torch's AdamW (MindSpore's eps 1e-6)."""

    def __init__(self, params: Iterable[Any], learning_rate: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-6, weight_decay: float = 0.0):
        super().__init__(_param_groups(params), lr=float(learning_rate), betas=(beta1, beta2), eps=eps,
                         weight_decay=weight_decay)


for _cls in (Momentum, SGD, Adam, AdamWeightDecay):
    _cls.parameters = property(_parameters)
    _cls.__call__ = _apply_gradients
