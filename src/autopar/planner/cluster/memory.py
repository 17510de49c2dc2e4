"""Memory on a device of the cluster: the optimizer state each ZeRO level leaves, and the activations a stage keeps.

Mixed-precision Adam keeps 16 bytes a parameter (bf16 weight and gradient, fp32 master weight and two moments --
ZeRO's K = 12), divided as the level says -- 18 under Megatron's data parallelism (ZeRO 0, and 1 as its distributed
optimizer), whose gradients are fp32; a stage keeps the activations of the micro-batches its schedule has in
flight (Megatron-LM's ``theoretical_memory_usage.py``). A layer's own activations come from the operators its plan
keeps for the backward, less what is counted twice (``kept_twice``), and what sequence parallelism splits
(``whole_on_every_device``).
"""
from __future__ import annotations

from torch.distributed.tensor import Shard

from autopar.planner.costs import nbytes
from autopar.planner.graph import Graph

WEIGHT_GRAD_BYTES = 4  # bf16 weight + bf16 gradient per parameter
# Megatron-LM accumulates and reduces bf16 training's gradients in fp32 (megatron/training/arguments.py: "bfloat16
# requires gradient accumulation and all-reduce to be done in fp32"), so a parameter costs 18 bytes, 6 + 12 / dp under
# its distributed optimizer (theoretical_memory_usage.py: ``18 if not args.use_distributed_optimizer else 6 + (12 /
# args.data_parallel_size)``)
MAIN_GRAD_BYTES = 4
OPTIMIZER_BYTES = 12  # fp32 master weight, Adam's two moments
MEMORY_HEADROOM = 0.9  # of a device's memory: the rest is workspace, allocator fragmentation, the CUDA context
# The loss over the logits runs in fp32 in every stack the planner predicts: torch.autocast runs cross_entropy's
# log_softmax in fp32 (its fp32 list), torchtitan calls it on ``pred.float()`` (torchtitan/components/loss.py),
# Megatron-core's vocab-parallel cross entropy upcasts (tensor_parallel/cross_entropy.py, ``calculate_logits_max``:
# ``vocab_parallel_logits.float()``). Its backward holds the fp32 probabilities it kept, their gradient and the
# logits' gradient at once (autograd's log_softmax backward: saved output, grad_output, grad_input), 3 x 4 bytes a
# logit, while every layer's kept activations are still alive -- the last stage's peak; the bf16 logits themselves
# are gone by then (torchtitan ``del pred`` before the backward; nothing saves a projection's output).
LOSS_BYTES_PER_LOGIT = 12


# FSDP inside pipeline stages, as torchtitan runs it: the stage's weights are not resharded after the forward
# (torchtitan's ``fsdp_reshard_after_forward`` "default": ``not pp_enabled``, "to avoid per-microbatch all-gathers"),
# and torch.distributed.pipelining turns gradient sync and resharding off until the last backward
# (``stage.backward_maybe_with_nosync``: ``set_requires_gradient_sync(False)``), so FSDP2 accumulates the unsharded
# gradients in the reduce dtype (``FSDPParam.unsharded_accumulated_grad``), fp32 under torchtitan's default
# ``mixed_precision_reduce = "float32"``
REDUCE_BYTES = 4


def weight_state_bytes(zero: int, params: float, replicas: int, itemsize: int, unit_params: float,
                       staged: bool = False) -> float:
    """Weights, gradients and optimizer state of ``params`` parameters on one device under ZeRO ``zero`` over
    ``replicas`` (ZeRO-3 also holds two gathered units -- the layer in hand and the one prefetched). ``staged``: a
    pipeline stage's; ZeRO-3 there is FSDP as torchtitan runs it under pipelines, the stage's weights whole in the
    compute dtype and its gradients whole in fp32 for the whole step, beside the shards. (ZeRO-2 there is ZeRO-2:
    the weights whole, gradients and optimizer state sharded -- Llama 3's FSDP, arXiv 2407.21783 sec. 3.3.2: "shards
    the optimizer states and gradients, but for model shards we do not reshard after forward computation".)"""
    r = replicas
    if staged and zero == 3:  # the stage's gradients whole in fp32, whatever the compute dtype
        return params * ((WEIGHT_GRAD_BYTES + OPTIMIZER_BYTES) / r + itemsize + REDUCE_BYTES)
    # a gathered unit's gradient, and in low precision its fp32 copy to reduce (fp32 training reduces its own)
    reduce = REDUCE_BYTES if itemsize < REDUCE_BYTES else 0
    optimizer = OPTIMIZER_BYTES if itemsize < 4 else OPTIMIZER_BYTES - 4  # fp32 training keeps no master copy
    return {0: params * (itemsize + MAIN_GRAD_BYTES + optimizer),
            1: params * (itemsize + MAIN_GRAD_BYTES + optimizer / r),
            2: params * (itemsize + (itemsize + OPTIMIZER_BYTES) / r),
            3: params * (WEIGHT_GRAD_BYTES + OPTIMIZER_BYTES) / r + unit_params * (2 * itemsize + itemsize
                                                                                    + reduce)}[zero]


def loss_peak_bytes(logits_bytes: float, itemsize: int) -> float:
    """The loss's peak on a device whose share of the logits is ``logits_bytes`` in the compute dtype
    (``LOSS_BYTES_PER_LOGIT`` a logit)."""
    return logits_bytes / itemsize * LOSS_BYTES_PER_LOGIT


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


