"""``mindspore.ops.operations.comm_ops`` path: the communication operators, and ``_VirtualDataset`` (the marker
MindSpore's ``VirtualDatasetCell`` puts before a network: each rank's inputs are its slice of the global batch).
Here every parallel mode already takes each rank's inputs as its part of the batch, so the marker passes them on."""
from __future__ import annotations

from typing import Any

from autopar.ops.comm import AllGather, AllReduce, AlltoAll, Broadcast, ReduceOp, ReduceScatter  # noqa: F401
from autopar.ops.primitive import Primitive


class _VirtualDataset(Primitive):
    """``_VirtualDataset()(*inputs)`` -> ``inputs`` (a tuple, as MindSpore's: ``backbone(*virtual(*inputs))``)."""

    def forward(self, *inputs: Any) -> tuple:
        return tuple(inputs)
