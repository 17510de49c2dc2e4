"""Losses. ``SoftmaxCrossEntropyExpand`` is the tutorials' loss, built from small operators exactly as written
there, so that each operator can be given a shard strategy (or be chosen by the auto-parallel planner).
``SoftmaxCrossEntropyWithLogits`` is the fused equivalent (one torch kernel; faster for data parallel). The others
are torch's losses with MindSpore's names and defaults (integer labels of any width taken as class indices).

``SoftmaxCrossEntropyWithLogits``'s default ``reduction='none'`` gives one loss per sample: MindSpore back-propagates
such a loss with a sensitivity of ones (the sum's gradient); ``TrainOneStepCell`` and ``value_and_grad`` do too."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import autopar.ops as ops
from autopar.nn.cell import Cell


class SoftmaxCrossEntropyExpand(Cell):
    def __init__(self, sparse: bool = False):
        super().__init__()
        self.exp = ops.Exp()
        self.sum = ops.ReduceSum(keep_dims=True)
        self.onehot = ops.OneHot()
        self.on_value = torch.tensor(1.0, dtype=torch.float32)
        self.off_value = torch.tensor(0.0, dtype=torch.float32)
        self.div = ops.RealDiv()
        self.log = ops.Log()
        self.sum_cross_entropy = ops.ReduceSum(keep_dims=False)
        self.mul = ops.Mul()
        self.mul2 = ops.Mul()
        self.mean = ops.ReduceMean(keep_dims=False)
        self.sparse = sparse
        self.max = ops.ReduceMax(keep_dims=True)
        self.sub = ops.Sub()

    def construct(self, logit, label):
        logit_max = self.max(logit, -1)
        exp = self.exp(self.sub(logit, logit_max))
        exp_sum = self.sum(exp, -1)
        softmax_result = self.div(exp, exp_sum)
        if self.sparse:
            label = self.onehot(label, ops.shape(logit)[1], self.on_value.to(logit.device),
                                self.off_value.to(logit.device))
        softmax_result_log = self.log(softmax_result)
        loss = self.sum_cross_entropy((self.mul(softmax_result_log, label)), -1)
        loss = self.mul2(ops.scalar_to_array(-1.0).to(logit.device), loss)
        loss = self.mean(loss, -1)
        return loss


class SoftmaxCrossEntropyWithLogits(Cell):
    """MindSpore's ``nn.SoftmaxCrossEntropyWithLogits(sparse=False, reduction='none')``."""

    def __init__(self, sparse: bool = False, reduction: str = "none"):
        super().__init__()
        if reduction not in ("none", "mean", "sum"):
            raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
        self.sparse = sparse
        self.reduction = reduction

    def construct(self, logits, labels):
        if self.sparse:
            return F.cross_entropy(logits, labels.long(), reduction=self.reduction)
        return F.cross_entropy(logits, labels.to(logits.dtype), reduction=self.reduction)


def _class_indices(labels: torch.Tensor) -> torch.Tensor:
    """MindSpore's losses take int32 class indices (the samples' ``TypeCast(ms.int32)``); torch's take int64."""
    return labels.long() if not labels.is_floating_point() and labels.dtype != torch.bool else labels


class CrossEntropyLoss(Cell, torch.nn.CrossEntropyLoss):
    """``nn.CrossEntropyLoss(weight=None, ignore_index=-100, reduction='mean', label_smoothing=0.0)``: class indices
    of any integer dtype, or class probabilities (float labels of the logits' shape)."""

    def __init__(self, weight: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0):
        torch.nn.CrossEntropyLoss.__init__(self, weight, ignore_index=ignore_index, reduction=reduction,
                                           label_smoothing=label_smoothing)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.CrossEntropyLoss.forward(self, logits, _class_indices(labels))

    construct = forward


class NLLLoss(Cell, torch.nn.NLLLoss):
    def __init__(self, weight: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean"):
        torch.nn.NLLLoss.__init__(self, weight, ignore_index=ignore_index, reduction=reduction)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.NLLLoss.forward(self, logits, _class_indices(labels))

    construct = forward


def _regression_loss(torch_cls: type, doc: str) -> type:
    """A torch regression loss under MindSpore's name: labels cast to the logits' dtype (MindSpore's are often
    float64 numpy arrays), ``reduction`` as MindSpore spells it."""
    def __init__(self, reduction: str = "mean"):
        torch_cls.__init__(self, reduction=reduction)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch_cls.forward(self, logits, labels.to(logits.dtype))

    return type(torch_cls.__name__, (Cell, torch_cls), {"__init__": __init__, "forward": forward, "construct": forward,
                                                        "__module__": __name__, "__doc__": doc})


MSELoss = _regression_loss(torch.nn.MSELoss, "``nn.MSELoss(reduction='mean')``.")
L1Loss = _regression_loss(torch.nn.L1Loss, "``nn.L1Loss(reduction='mean')``; ``nn.MAELoss`` is the same loss.")
MAELoss = L1Loss


class SmoothL1Loss(Cell, torch.nn.SmoothL1Loss):
    """``nn.SmoothL1Loss(beta=1.0, reduction='none')`` (MindSpore's default reduction is 'none')."""

    def __init__(self, beta: float = 1.0, reduction: str = "none"):
        torch.nn.SmoothL1Loss.__init__(self, reduction=reduction, beta=beta)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.SmoothL1Loss.forward(self, logits, labels.to(logits.dtype))

    construct = forward


class BCEWithLogitsLoss(Cell, torch.nn.BCEWithLogitsLoss):
    """``nn.BCEWithLogitsLoss(reduction='mean', weight=None, pos_weight=None)``."""

    def __init__(self, reduction: str = "mean", weight: torch.Tensor | None = None,
                 pos_weight: torch.Tensor | None = None):
        torch.nn.BCEWithLogitsLoss.__init__(self, weight=weight, reduction=reduction, pos_weight=pos_weight)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.BCEWithLogitsLoss.forward(self, logits, labels.to(logits.dtype))

    construct = forward
