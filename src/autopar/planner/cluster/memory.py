"""Memory on a device of the cluster: the optimizer state each ZeRO level leaves, and the activations a stage keeps.

Mixed-precision Adam keeps 16 bytes a parameter (bf16 weight and gradient, fp32 master weight and two moments --
ZeRO's K = 12), divided as the level says; a stage keeps the activations of the micro-batches its schedule has in
flight (Megatron-LM's ``theoretical_memory_usage.py``). A layer's own activations come from the operators its plan
keeps for the backward, less what is counted twice (``kept_twice``), and what sequence parallelism splits
(``whole_on_every_device``).
"""
from __future__ import annotations

from torch.distributed.tensor import Shard

from autopar.planner.costs import nbytes
from autopar.planner.graph import Graph

WEIGHT_GRAD_BYTES = 4  # bf16 weight + bf16 gradient per parameter
OPTIMIZER_BYTES = 12  # fp32 master weight, Adam's two moments
MEMORY_HEADROOM = 0.9  # of a device's memory: the rest is workspace, allocator fragmentation, the CUDA context


def weight_state_bytes(zero: int, params: float, replicas: int, itemsize: int, unit_params: float) -> float:
    """Weights, gradients and optimizer state of ``params`` parameters on one device under ZeRO ``zero`` over
    ``replicas`` (ZeRO-3 also holds two gathered units -- the layer in hand and the one prefetched)."""
    r = replicas
    return {0: params * (WEIGHT_GRAD_BYTES + OPTIMIZER_BYTES),
            1: params * (WEIGHT_GRAD_BYTES + OPTIMIZER_BYTES / r),
            2: params * (itemsize + (itemsize + OPTIMIZER_BYTES) / r),
            3: params * (WEIGHT_GRAD_BYTES + OPTIMIZER_BYTES) / r + 2 * unit_params * itemsize}[zero]


def kept_twice(graph: Graph, chosen) -> float:
    """Bytes counted twice among the operators' activations: an input two operators take as the same tensor in the
    same layout (q and kv of one norm's output) is kept once."""
    total = 0.0
    for node, c in zip(graph.nodes, chosen):
        for i, (j, k) in node.same_input.items():
            if c.in_placements[i] == chosen[j].in_placements[k]:
                total += nbytes(c.plan.inputs[i].slice_shape, node.itemsize)
    return total


def whole_on_every_device(graph: Graph, chosen) -> float:
    """Bytes of the activations the tensor group keeps whole on every device: the inputs that come from outside
    the planned operators (a norm's output) into an operator split another way (a column-split projection), and the
    outputs left whole or as partial sums (a row-split projection's, on its way to the residual). Sequence
    parallelism keeps each of them split on the sequence."""

    total = 0.0
    for node, c in zip(graph.nodes, chosen):
        for i, src in node.in_sources.items():
            if not isinstance(src, int) and node.param_names[i] is None and i not in node.same_input \
                    and not any(isinstance(p, Shard) for p in c.in_placements[i]):
                total += nbytes(c.plan.inputs[i].slice_shape, node.itemsize)
        if not any(isinstance(p, Shard) for p in c.out_placements):
            total += c.out_bytes
    return total


