"""``WithLossCell``: MindSpore's pairing of a backbone and its loss (the network the training step runs)."""
from __future__ import annotations

from autopar.nn.cell import Cell


class WithLossCell(Cell):
    def __init__(self, backbone, loss_fn):
        super().__init__()
        self._backbone = backbone
        self._loss_fn = loss_fn

    def construct(self, data, label):
        return self._loss_fn(self._backbone(data), label)

    @property
    def backbone_network(self):
        return self._backbone
