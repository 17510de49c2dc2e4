"""Losses. ``SoftmaxCrossEntropyExpand`` is the tutorials' loss, built from small operators exactly as written
there, so that each operator can be given a shard strategy (or be chosen by the auto-parallel planner).
``SoftmaxCrossEntropyWithLogits`` is the fused equivalent (one torch kernel; faster for data parallel)."""
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
