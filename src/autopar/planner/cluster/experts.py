"""A mixture of experts on the cluster: the router, the tokens' trip to their experts' ranks and back (all-to-all
over the expert-parallel group), the experts' grouped GEMMs, and what the block keeps for its backward.

The block as Megatron-Core runs it (``megatron/core/transformer/moe/``: ``router.py``, ``token_dispatcher.py``,
``experts.py``), dropless, with the routing balanced (each expert receives ``tokens x top_k / experts`` of the
group's tokens -- what the vendor tables measure: "we force-balance the token distribution among experts",
Megatron-Bridge's performance summary):

- the router: a linear of ``hidden x experts`` on every rank's tokens, a softmax and a top-k;
- expert parallelism over ``ep`` consecutive ranks (Megatron's expert rank order, expert tensor parallelism 1: the
  expert mesh folded over the attention's tensor x context x data ranks, "MoE Parallel Folding", arXiv 2504.14960),
  each rank holding ``experts / ep`` whole experts and running them on what it receives;
- the dispatch: ``alltoall`` -- Megatron's ``MoEAlltoAllTokenDispatcher``, one copy of a token per expert it
  chose, permuted by expert and sent with NCCL's all-to-all -- or ``deepep`` -- DeepEP's (and NVIDIA's HybridEP,
  Megatron's ``flex`` dispatcher) fused kernels, which send a token once to each node holding one of its experts
  over RDMA and once to each rank over NVLink (deepseek-ai/DeepEP README: "forwarding data from NVLink domain to
  RDMA domain"); the combine returns the same bytes, and the backward runs both again: four all-to-alls a layer
  and micro-batch, on the compute stream (exposed) unless the run overlaps them with another micro-batch's
  compute (Megatron's ``--overlap-moe-expert-parallel-comm``: ``layers.py``);
- the experts: gate and up as one grouped GEMM (``hidden -> 2 x expert_ffn``), SwiGLU, down (``expert_ffn ->
  hidden``), each of the rank's experts on its share of the tokens, at that shape's rate (``kernels.py``);
- memory-bound work: the permutation and its inverse (a row gathered per copy), SwiGLU, the router's softmax and
  top-k, forward and backward ~3x the forward's traffic, as the layers' other element-wise work is costed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.planner.cluster.collectives import all_to_all_seconds, placement
from autopar.planner.cluster.kernels import fp8_cast_bytes

DISPATCHERS = ("alltoall", "deepep")


@dataclass(frozen=True)
class ExpertBlock:
    """One layer's mixture of experts on one rank for one micro-batch."""
    time: float  # forward + backward seconds, the exposed all-to-alls included
    forward: float  # what a recomputed forward runs again (its two all-to-alls too)
    compute: float  # forward + backward seconds of the GEMMs and the memory-bound work alone
    dispatch: float  # the four all-to-alls' seconds (forward + backward)
    activation_bytes: float
    param_count: float  # this rank's experts' weights (experts / ep of them)
    router_param_count: float  # the router's, on every rank
    rows: tuple  # the explanation's rows, as LayerPlan.rows gives them


def destination_odds(experts: int, top_k: int, held: int) -> float:
    """The probability that a token routed to ``top_k`` distinct experts of ``experts``, uniformly, chose at least
    one of the ``held`` experts of a given rank or node (hypergeometric: none of its choices among them)."""
    if held >= experts:
        return 1.0
    return 1.0 - math.comb(experts - held, top_k) / math.comb(experts, top_k)


def dispatch_bytes(config, spec, tokens: float, ep: int, dispatcher: str, itemsize: int) -> tuple[float, float]:
    """(bytes to other nodes, bytes to other ranks of the node) one rank sends in one dispatch (a combine returns
    as many) over an expert-parallel group of ``ep`` consecutive ranks."""
    e, k, h = config.experts, config.experts_chosen, config.hidden
    per_node, nodes = placement(spec, ep, 1)
    row = h * itemsize
    if dispatcher == "alltoall":  # a copy a chosen expert, spread evenly over the group's experts
        copies = tokens * k * row
        return copies * (ep - per_node) / ep, copies * (per_node - 1) / ep
    local = e // ep  # experts a rank holds
    rank = destination_odds(e, k, local)
    node = destination_odds(e, k, local * per_node)
    # a token crosses the network once to each other node holding one of its experts, and NVLink once to each rank
    # of a node that holds one (its own node's other ranks, and each remote node's ranks the token is forwarded to
    # there -- as many, in balance, as this rank forwards for others)
    return tokens * (nodes - 1) * node * row, tokens * nodes * (per_node - 1) * rank * row


def expert_block(config, spec, machine, tokens: float, ep: int, dispatcher: str, itemsize: int,
                 fp8_recipe: str | None = None) -> ExpertBlock:
    """The block for a rank holding ``tokens`` of a micro-batch (its share of the sequence, 1/t of it under
    sequence parallelism), ``machine`` its :class:`~autopar.planner.cluster.kernels.GroupMachine` (the dtype's
    rates: fp8's for the experts' GEMMs under fp8, as Transformer Engine's grouped linears run them, their
    operands cast as ``fp8_recipe`` says: ``kernels.FP8_CAST_BYTES``)."""
    e, k, h, f = config.experts, config.experts_chosen, config.hidden, config.expert_ffn_size
    local = e // ep
    received = tokens * k  # copies a rank's experts compute, in balance: as many as it sends
    rows = max(1, math.ceil(received / local))  # an expert's tokens
    fc1 = machine.gemm_seconds(local, rows, 2 * f, h)
    fc2 = machine.gemm_seconds(local, rows, h, f)
    router = machine.gemm_seconds(1, max(1, math.ceil(tokens)), e, h, projection=False)
    gemms = 3 * (fc1 + fc2 + router)  # forward, then the input- and weight-gradient GEMMs
    # memory-bound forward traffic: the router's softmax and top-k over the logits (read, write, read), the
    # permutation (a row read and written per copy), SwiGLU (gate and up read, the product written), the weighted
    # un-permutation (a row read per copy, the token written)
    traffic = (3 * tokens * e + 2 * received * h + 3 * received * f + received * h + tokens * h) * itemsize
    other = 3 * traffic / spec.memory_bandwidth
    casts = cast_forward = 0.0
    if fp8_recipe:  # each grouped linear's copies, weights and output gradients cast to fp8 first
        for both, fwd in (fp8_cast_bytes(fp8_recipe, received * h, local * h * 2 * f, received * 2 * f),
                          fp8_cast_bytes(fp8_recipe, received * f, local * f * h, received * h)):
            casts += both / spec.memory_bandwidth
            cast_forward += fwd / spec.memory_bandwidth
    off, on = dispatch_bytes(config, spec, tokens, ep, dispatcher, itemsize)
    one = all_to_all_seconds(spec, off, on, ep, 1)
    dispatch = 4 * one
    compute = gemms + other + casts
    # kept for the backward: the router's input and its logits and probabilities, each copy's row (the first
    # GEMM's input), gate and up (SwiGLU's input), SwiGLU's output (the second GEMM's input), each expert output
    # (the probability-weighted combine's), and the routing's indices (int64)
    kept = (tokens * h + 2 * tokens * e + received * (2 * h + 3 * f)) * itemsize + 2 * received * 8
    table = (
        ("router", "linear", f"{tokens:,.0f} x {h} -> {e}", "replicated", "every rank",
         3 * router * 1e3, 0.0),
        ("experts.fc1", "grouped linear", f"{local} x ({rows:,} x {h} -> {2 * f})", f"ep {ep}",
         f"{local} experts a rank", 3 * fc1 * 1e3, 0.0),
        ("experts.fc2", "grouped linear", f"{local} x ({rows:,} x {f} -> {h})", f"ep {ep}",
         f"{local} experts a rank", 3 * fc2 * 1e3, 0.0),
        ("experts.dispatch", "all-to-all", f"{(off + on) / 2**20:,.1f} MiB out a rank", dispatcher,
         "dispatch + combine, x2 backward", other * 1e3, dispatch * 1e3) if ep > 1 else
        ("experts.permute", "memory-bound", f"{received:,.0f} token copies", "local", "permute + combine",
         other * 1e3, 0.0),
    ) + ((("experts.fp8 casts", "memory-bound", f"{received:,.0f} token copies", fp8_recipe, "before each grouped "
           "linear", casts * 1e3, 0.0),) if fp8_recipe else ())
    return ExpertBlock(compute + dispatch, (fc1 + fc2 + router) + other / 3 + cast_forward + 2 * one, compute,
                       dispatch, kept, local * 3 * h * f, h * e, table)
