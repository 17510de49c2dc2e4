"""Evaluation metrics. Each rank evaluates its shard; totals are summed over ranks so every rank reports the
metric of the whole evaluation set (as one process would)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.errors import ConfigError


class Metric:
    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._num = torch.zeros(2, dtype=torch.float64)  # (numerator, denominator)

    def update(self, logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def eval(self, reduce_over_ranks: bool = True) -> float:
        totals = self._num.clone()
        if reduce_over_ranks and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(totals)
        if totals[1] == 0:
            raise ConfigError(f"{type(self).__name__}: no samples were evaluated")
        return float(totals[0] / totals[1])


class TopKCategoricalAccuracy(Metric):
    def __init__(self, k: int = 1):
        self.k = k
        super().__init__()

    def update(self, logits, labels, loss=None):
        labels = labels.reshape(-1).long()
        if labels.dim() and logits.dim() == 2 and labels.shape[0] != logits.shape[0]:
            raise ConfigError(f"accuracy: {logits.shape[0]} predictions for {labels.shape[0]} labels")
        top = logits.topk(self.k, dim=-1).indices
        correct = (top == labels.unsqueeze(-1)).any(-1).sum()
        self._num += torch.tensor([float(correct), float(labels.numel())], dtype=torch.float64)


class Accuracy(TopKCategoricalAccuracy):
    def __init__(self, eval_type: str = "classification"):
        super().__init__(k=1)


class Loss(Metric):
    def update(self, logits, labels, loss=None):
        if loss is None:
            raise ConfigError("the 'loss' metric needs a loss_fn in Model")
        n = labels.shape[0] if labels.dim() else 1
        self._num += torch.tensor([float(loss.detach().float().mean()) * n, float(n)], dtype=torch.float64)


_BY_NAME = {"acc": Accuracy, "accuracy": Accuracy, "loss": Loss, "top_1_accuracy": lambda: TopKCategoricalAccuracy(1),
            "top_5_accuracy": lambda: TopKCategoricalAccuracy(5)}


def build_metrics(metrics) -> dict[str, Metric]:
    if not metrics:
        return {}
    if isinstance(metrics, dict):
        return {name: m if isinstance(m, Metric) else _BY_NAME[m]() for name, m in metrics.items()}
    out = {}
    for name in metrics:
        if name not in _BY_NAME:
            raise ConfigError(f"unknown metric {name!r}; known: {', '.join(sorted(_BY_NAME))}")
        out[name] = _BY_NAME[name]()
    return out
