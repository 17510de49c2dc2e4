"""Attention on the cluster: the materialized core that selective recomputation drops, and context parallelism's
ring of key/value blocks."""
from __future__ import annotations

import dataclasses

from autopar.planner.cluster.collectives import behind
from autopar.planner.cluster.spec import ClusterSpec
from autopar.planner.costs import forward_backward_passes, nbytes


def with_context_parallel(plan, cp: int, spec: ClusterSpec):
    """A layer planned at ``1/cp`` of the sequence (a :class:`~autopar.planner.cluster.layers.LayerPlan`) made a
    context-parallel one (ring attention, Liu et al. 2023, arXiv 2310.01889; Megatron-LM's context parallelism): each device's queries meet every key, so its attention does
    ``cp`` times the work of the local block (with causal load balancing -- two mirrored chunks a device -- every
    device does ``1/cp`` of the whole), while the key/value blocks travel ``cp - 1`` hops round the group, ``t``
    ranks apart, in the forward, and the keys/values with their gradients (twice the bytes) in the backward. Each
    hop overlaps the attention of the block in hand, so only a ring slower than the attention shows, and the
    attention it slows while they share the GPU (``collectives.behind``)."""
    if cp == 1:
        return plan
    extra = extra_forward = exposed = 0.0
    for n, node in enumerate(plan.graph.nodes):
        if node.kind != "attention":
            continue
        c = plan.costs[n].choices[plan.choice[n]]
        attention = c.compute - c.optimizer  # forward + backward of the local block: 1 + 2.5 passes
        kv = sum(nbytes(c.plan.inputs[i].slice_shape, node.itemsize) for i in (1, 2))
        ring = spec.collective("all_gather", cp * kv, cp, plan.t)[0]  # cp - 1 blocks of k and v, one hop each
        extra += (cp - 1) * attention
        passes = forward_backward_passes(node)
        extra_forward += (cp - 1) * attention / passes
        exposed += behind(ring, cp * attention / passes, spec.overlap_slowdown) + behind(
            2 * ring, cp * attention * (passes - 1) / passes, spec.overlap_slowdown)
    return dataclasses.replace(plan, time=plan.time + extra + exposed, forward=plan.forward + extra_forward,
                               context_ring=exposed)


def attention_core(node) -> bool:
    """The attention core selective recomputation runs again in the backward (Korthikanti et al. 2022 sec. 5;
    Megatron-Core's ``--recompute-granularity selective``, whose ``--recompute-modules`` default is ``core_attn``):
    the materialized attention's scores matmul, softmax and context matmul (``attention.*``), or the fused kernel --
    Megatron-Core checkpoints Transformer Engine's fused attention too, keeping q, k and v and running the kernel's
    forward again."""
    return node.name.split(".")[-2:-1] == ["attention"] and node.kind in ("matmul", "softmax", "attention")


def kept_by_core(node, choice) -> float:
    """Bytes the attention core keeps for its backward that selective recomputation drops: the materialized
    scores and their softmax (``[b, heads, rows, s]``), or the fused kernel's log-sum-exp -- its output stays, the
    input the projection after it keeps (counted here, as every node's output is)."""
    if node.kind == "attention":
        return choice.activation_bytes - choice.out_bytes
    return choice.out_bytes if node.kind == "softmax" or node.name.endswith(".scores") else 0.0
