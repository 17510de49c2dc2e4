"""Context and expert parallelism as AUTO_PARALLEL weighs them: variants of the data-parallel plan.

Neither is a choice of one operator's layout, so neither is in the operator search
(:mod:`autopar.planner.search`); each changes how the whole batch is divided, as ZeRO changes how the optimizer is:

- *context parallelism* over ``cp`` ranks (``dp x cp``): every token-wise module runs on ``1/n`` of the tokens as
  under data parallel, but the batch is divided ``dp`` ways and the sequence ``cp`` ways -- so a global batch that
  the ranks do not divide (Megatron's contract: a few long sequences, ``full_batch``) still splits. Each attention
  gathers its keys and values over the ``cp`` ranks and reduce-scatters their gradients
  (:mod:`autopar.parallel.tensor.context`). Weighed where the network's attention is SDPA, nothing in it mixes
  positions otherwise (a convolution, an RNN), and its inputs share a sequence dimension the ranks divide;
- *expert parallelism*: each module of stacked experts keeps ``E/n`` experts, each token sent to its experts' ranks
  and its results back by all-to-alls (:mod:`autopar.parallel.tensor.experts`); the experts' gradients need no
  all-reduce, and their weights and optimizer state take ``1/n`` of the memory.

Their predictions start from data parallel's step (measured whole in a job, where it was) and add what the
variant adds: the layout runtime's dispatch, its gradient all-reduce without DDP's overlap, and the variant's own
collectives at the machine's measured rates. They are bets for the measured round
(:mod:`autopar.parallel.trials`), which runs the close ones and keeps the fastest.
"""
from __future__ import annotations

import math

from autopar.planner.costs import OPTIMIZER_SLOTS
from autopar.planner.graph import Graph
from autopar.planner.machine import MachineModel


def _divides(graph: Graph, n: int) -> int:
    """Into how many parts data parallel splits the batch: every device, or -- where they do not divide it -- none
    (:func:`autopar.layout.strategy.data_parallel_strategy`)."""
    return n if graph.batch % n == 0 else 1


def context_degrees(graph: Graph, n: int, algo: str = "all_gather") -> list[int]:
    """The ``cp`` degrees a sequence split can take here (empty where it cannot run): the world mesh must hold the
    ``(n/cp, cp)`` matrix (one axis per prime factor of n, the split on the trailing ones), DeepSpeed-Ulysses
    (``algo``) needs heads the group divides, and the ring two equal chunks of the sequence per rank."""
    if n < 2 or not graph.attention or graph.mixes_tokens or not graph.sequence:
        return []
    if not all(len(q) == 4 and len(k) == 4 for q, k, *_ in graph.attention):  # (batch, heads, sequence, head_dim)
        return []
    out = []
    for cp in range(2, n + 1):
        if n % cp or graph.sequence % cp or graph.batch % (n // cp) or not _lies_on_mesh((n // cp, cp), n):
            continue
        if algo == "ulysses" and any(q[1] % cp or k[1] % cp for q, k, *_ in graph.attention):
            continue
        if algo == "ring" and graph.sequence % (2 * cp) and any(causal for *_, causal, _ in graph.attention):
            continue
        out.append(cp)
    return out


def _lies_on_mesh(matrix: tuple[int, ...], n: int) -> bool:
    from autopar.errors import StrategyError
    from autopar.layout.axes import axes_of_device_matrix, mesh_shape_for

    try:
        axes_of_device_matrix(matrix, mesh_shape_for(n))
    except StrategyError:
        return False
    return True


def _layout_overheads(machine: MachineModel, n: int, grads: list[float], kept: float, dispatch: float) -> tuple:
    """(compute, communication) the layout runtime adds to data parallel's step: DTensor's dispatch, the optimizer's
    per-parameter loop on DTensors (``kept`` bytes of parameters on this device) where DDP ran the fused kernel, and
    one all-reduce per replicated gradient (``grads``: their bytes) where DDP's buckets overlapped the backward."""
    everything = sum(grads)
    optimizer = kept / machine.optimizer_rate("layout") - everything / machine.optimizer_rate("fused")
    return dispatch + max(0.0, optimizer), sum(machine.collective("all_reduce", g, n) for g in grads)


def context_totals(graph: Graph, machine: MachineModel, dp_totals, n: int, cp: int, grads: list[float],
                   dispatch: float, algo: str = "all_gather"):
    """The step of a ``dp x cp`` sequence split, from data parallel's (``dp_totals``: the batch split as
    :func:`_divides` says), attention met as ``algo`` (``context_parallel_algo``) says. ``grads``: the bytes of each
    trainable parameter; ``dispatch``: a layout's DTensor dispatch per step
    (:func:`autopar.planner.plan.dispatch_of`). Returns (compute, communication, memory)."""
    parts = _divides(graph, n)
    share = parts / n  # of data parallel's per-device work, what a token split leaves each device
    state = sum(grads) * (2 + OPTIMIZER_SLOTS)
    extra, comm = _layout_overheads(machine, n, grads, sum(grads), dispatch)
    compute = dp_totals.compute * share + extra
    kept = 0.0
    for q, k, v, item, causal, blockwise in graph.attention:
        kv = (math.prod(k) + math.prod(v)) * item / (n // cp)  # this data-parallel group's keys and values, whole
        local = (math.prod(q) * item / (n // cp) + kv) / cp  # this rank's query, keys and values
        whole = 3 * 4 * math.prod(q) * k[-2]  # forward + backward FLOPs of the unmasked product, whole batch
        last = whole / (n // cp) / cp  # this rank's share of them, every key
        if algo == "ring" and blockwise:  # cp - 1 hops of a key-value block forward, as many back and cp of
            # their gradients (hidden behind the blocks' attention they pass beside); causal: each rank's tokens
            # moved to the mirrored chunks and back (query, keys, values and the output, forward and backward: on
            # two ranks half of them, on more nearly all)
            hops = (3 * cp - 2) * machine.collective("all_to_all", 2 * kv / cp, 2)  # (a pair's exchange: one block)
            last /= 2 if causal else 1
            comm += hops - machine.hidden(hops, machine.compute("attention", last))
            if causal:
                moved = (local + math.prod(q) * item / (n // cp) / cp) * (1 if cp == 2 else 2)
                comm += 2 * machine.collective("all_to_all", moved, 2)
                kept += local  # the mirrored copies the ring keeps for its backward (the blocks in flight --
                # the one in hand, the one arriving -- are one layer's at a time, not kept)
        elif algo == "ulysses":  # query, keys, values and the output onto a split of the heads and back, both ways
            comm += 2 * machine.collective("all_to_all", local + math.prod(q) * item / (n // cp) / cp, cp)
            last /= 2 if causal else 1
            kept += local  # the head-split copies attention keeps for its backward
        else:  # keys and values gathered forward, their gradients reduce-scattered (the ring's call where it
            # cannot run as one: a mask, not the CPU's kernel)
            comm += machine.collective("all_gather", kv, cp) + machine.collective("reduce_scatter", kv, cp)
            kept += kv * (cp - 1) / cp  # kept for the backward beside the local slices
            if causal:  # the last slice's queries see every key: on the CPU's blockwise kernel it computes cp - 1/2
                # of the cp x cp blocks, the first 1/2 (no load balancing); elsewhere the masked kernel computes all
                # cp of them; the step waits for the last
                last *= ((cp - 0.5) if blockwise else cp) / cp
        if causal:  # data parallel's share of the causal half replaced by this rank's
            compute += machine.compute("attention", last) - share * machine.compute("attention", whole / 2 / parts)
    memory = state + max(0.0, dp_totals.memory - state) * share + kept
    return compute, comm, memory


def expert_parallel_ok(graph: Graph, n: int) -> bool:
    """Every module of stacked experts splits over the ``n`` ranks (experts and tokens)."""
    return n > 1 and _lies_on_mesh((n,), n) and bool(graph.experts) and all(
        experts % n == 0 and math.prod(hidden[:-1]) % n == 0 for _, _, hidden, _, experts, _ in graph.experts)


def experts_timed(graph: Graph, machine: MachineModel, n: int) -> tuple[float, float] | None:
    """(data parallel's, expert parallelism's) seconds of the network's modules of stacked experts, forward and
    backward, timed in a job (:meth:`autopar.planner.op_timer.OpTimer.experts`); None outside one, or where a
    module could not be timed."""
    timer = getattr(machine, "op_timer", None)
    if timer is None:
        return None
    dp = ep = 0.0
    for module, _, hidden, _, _, chosen in graph.experts:
        timed = timer.experts(module, math.prod(hidden[:-1]), hidden[-1], chosen, _divides(graph, n), n)
        if timed is None:
            return None
        dp, ep = dp + timed[0], ep + timed[1]
    return dp, ep


def expert_totals(graph: Graph, machine: MachineModel, dp_totals, n: int, grads: list[float],
                  expert_grads: list[float], dispatch: float, timed: tuple[float, float] | None = None):
    """Data parallel with every module of stacked experts split by expert over the ``n`` ranks, from data
    parallel's step; ``grads``: the bytes of every trainable parameter outside the experts, ``expert_grads``: of
    those inside. ``timed``: the experts' modules' seconds under data parallel and under expert parallelism, timed
    in the job (:func:`experts_timed`): the data-parallel step, as measured, has its experts' modules replaced by
    their time split by expert -- where the step was measured whole, the step as measured (what it takes beyond
    the summed operators is the experts' own indexing and scattering as much as communication: DDP hides the
    gradients' all-reduce behind their backward); else from FLOPs, the same compute as data parallel's. Returns
    (compute, communication, memory)."""
    expert_bytes = sum(expert_grads)
    extra, comm = _layout_overheads(machine, n, grads, sum(grads) + expert_bytes / n, dispatch)
    # (the experts' gradients are this rank's own: no all-reduce -- their share of the fused step is taken off)
    extra -= expert_bytes / machine.optimizer_rate("fused")
    base = dp_totals.compute
    if timed is not None:
        dp_experts, ep_experts = timed
        base = max(0.0, (dp_totals.step if dp_totals.measured else dp_totals.compute) - dp_experts) + ep_experts
    gathered = 0.0
    for _, _, hidden, item, _, chosen in graph.experts:  # each token sent to the ranks of its experts (at most
        # min(k, n) of them, spread evenly: the planner does not know the routing) and its result back, both
        # backward; a rank runs its experts over about min(k, n)/n of the tokens
        sent = math.prod(hidden) * item / n * min(chosen, n)  # this rank's tokens, as many times as they go out
        comm += 4 * machine.collective("all_to_all", sent, n)
        # and their routing with them (the dispatcher's counts, each token's experts and weights; the weights'
        # gradient back): small messages, each a collective's latency
        routes = math.prod(hidden[:-1]) / n * min(chosen, n) * chosen
        comm += (machine.collective("all_to_all", 8.0 * n, n) + machine.collective("all_to_all", 8.0 * routes, n)
                 + 2 * machine.collective("all_to_all", item * routes, n))
        gathered += sent * 2  # what it received and the results it sends back, kept for the backward
    saved = expert_bytes * (2 + OPTIMIZER_SLOTS) * (n - 1) / n
    return base + extra, comm, dp_totals.memory - saved + gathered
