"""Collectives on a cluster's topology, as NCCL runs them.

nccl-tests' definition of bus bandwidth: a collective of ``S`` bytes on ``n`` devices moves ``f(n) * S`` through each
device's slowest link, ``f`` = 2(n-1)/n for all-reduce and (n-1)/n for all-gather / reduce-scatter / all-to-all.
Inside one node the bus bandwidth is the intra-node link's; across ``k`` nodes with ``m`` group members per node, the
ring crosses the network on the members' own NICs (rail aligned), so the bus bandwidth is ``min(intra, m * nic)``.
Latency: a ring pays a hop per member and step; a tree (all-reduce across nodes) pays ``2 log2(k)`` network hops but
moves each byte twice -- the cheaper one is used, as NCCL's tuner picks between them.
"""
from __future__ import annotations

import math

from autopar.planner.cluster.memory import MAIN_GRAD_BYTES, REDUCE_BYTES
from autopar.planner.machine import RING

# NCCL's ring latencies per protocol (src/graph/tuning.cc, github.com/NVIDIA/nccl): baseLat, once a collective
# (Ring: LL128 14.0 us, Simple 8.4 us) and hwLat per hop for Simple (Ring: NVLink 3.4 us, network 14.0 us); LL128's
# hops are the presets' link latencies (hwLat Ring LL128: NVLink 1.9 us, network 4.0 us)
NCCL_BASE_LATENCY = {"LL128": 14.0e-6, "Simple": 8.4e-6}
NCCL_SIMPLE_HOP = {"intra": 3.4e-6, "inter": 14.0e-6}
# How much slower compute runs while a collective runs beside it: NCCL's kernels hold SMs and move each byte through
# HBM two or three times ("300GB/s needs to be multiplied by at least 2x for memory bandwidth", NCCL's maintainers,
# NVIDIA/nccl#1428), so a GEMM, an attention kernel or an element-wise kernel overlapped with a collective takes
# longer than alone. Measured, not fitted: 18.9 % on average over the overlapped compute of GPT and Llama training
# steps on 4 A100 and 4 H100 (Lee et al. 2025, "Characterizing Compute-Communication Overlap in GPU-Accelerated
# Distributed Deep Learning", arXiv 2507.03114, abstract: "an average computational slowdown of 18.9%, with a
# maximum of 40.0%")
OVERLAP_SLOWDOWN = 0.189


def behind(comm: float, window: float, slowdown: float) -> float:
    """Seconds a collective of ``comm`` seconds adds to a step when launched under ``window`` seconds of compute:
    what sticks out past the compute, and the compute it slows while the two run together (``slowdown``, the
    cluster's ``overlap_slowdown``: during the ``min(comm, window)`` seconds they share, the compute gets through
    1 / (1 + slowdown) of its work)."""
    shared = max(0.0, min(comm, window))
    return max(0.0, comm - window) + shared * slowdown / (1.0 + slowdown)


def placement(spec, size: int, stride: int) -> tuple[int, int]:
    """(members per node, nodes) of a group of ``size`` devices ``stride`` ranks apart (ranks fill nodes)."""
    if size <= 1:
        return 1, 1
    per_node = max(1, min(size, spec.devices_per_node // stride)) if stride < spec.devices_per_node else 1
    return per_node, math.ceil(size / per_node)



def collective_seconds(spec, kind: str, nbytes: float, size: int, stride: int = 1) -> tuple[float, str]:
    """Seconds and algorithm ("ring" / "tree") of a collective on a group placed with ``stride``.

    A ring runs NCCL's faster protocol for its size (NCCL's tuner): LL128, whose hops are the links' own
    latencies and whose lines carry 120 bytes of data in 128, or Simple, full bandwidth for longer hops and
    base latency -- so a small collective on thousands of ranks pays thousands of hops, and a large one its
    bytes. A cluster described by a calibration (this host, not NCCL) pays its links' figures alone."""
    if size <= 1 or nbytes <= 0:
        return 0.0, "none"
    m, k = placement(spec, size, stride)
    factor = RING[kind](size)
    steps = 2 if kind == "all_reduce" else 1
    bus = spec.intra.effective if k == 1 else min(spec.intra.effective, m * spec.nic_per_device)
    inter_hops, intra_hops = (0, size - 1) if k == 1 else (k, size - k)
    ring = steps * (inter_hops * spec.inter.latency + intra_hops * spec.intra.latency) + factor * nbytes / bus
    if spec.nccl:
        ll128 = NCCL_BASE_LATENCY["LL128"] + ring + factor * nbytes / bus * (128 / 120 - 1)
        simple = NCCL_BASE_LATENCY["Simple"] + steps * (inter_hops * max(NCCL_SIMPLE_HOP["inter"], spec.inter.latency)
                                                        + intra_hops * max(NCCL_SIMPLE_HOP["intra"], spec.intra.latency)) \
            + factor * nbytes / bus
        ring = min(ll128, simple)
    if kind != "all_reduce" or k == 1:
        return ring, "ring"
    tree = 2 * (math.ceil(math.log2(k)) * spec.inter.latency + (m - 1) * spec.intra.latency) + 2 * nbytes / bus \
        + (NCCL_BASE_LATENCY["LL128"] if spec.nccl else 0.0)  # a tree pays NCCL's base latency as a ring does
    return (tree, "tree") if tree < ring else (ring, "ring")



def all_to_all_seconds(spec, off_node: float, on_node: float, size: int, stride: int = 1) -> float:
    """Seconds of an all-to-all in which each member of a group of ``size`` (``stride`` ranks apart) sends
    ``off_node`` bytes to members on other nodes and ``on_node`` bytes to other members on its own node.

    An all-to-all is point-to-point sends to every peer at once: the bytes leaving the node go through the sender's
    own NIC -- "Alltoall cannot aggregate the bandwidth of multiple NICs, so the performance you should see is the
    performance of a single NIC" (NCCL's maintainers, NVIDIA/nccl-tests#267) and "the portion that's going through
    the network will determine the global time" (NVIDIA/nccl-tests#130) -- the rest over NVLink at the same time;
    the slower of the two sets the time. Its latency is a collective's base latency and one hop (the sends to the
    peers run concurrently). The same bound holds for DeepEP's kernels, which reach the NIC's line rate across nodes
    and NVLink's inside one ("Bottleneck bandwidth" 43-58 GB/s RDMA on 50 GB/s CX7 NICs, 153-158 GB/s on H800's
    ~160 GB/s NVLink: deepseek-ai/DeepEP docs/legacy.md, 'Normal kernels with NVLink and RDMA forwarding'); what
    they save is bytes (``experts.py``)."""
    if size <= 1 or off_node + on_node <= 0:
        return 0.0
    _, nodes = placement(spec, size, stride)
    hop = spec.inter.latency if nodes > 1 else spec.intra.latency
    base = NCCL_BASE_LATENCY["Simple"] if spec.nccl else 0.0
    return base + hop + max(off_node / spec.nic_per_device if nodes > 1 else 0.0, on_node / spec.intra.effective)


def data_parallel_sync(spec, zero: int, m: int, grads: float, unit: float, layers: int, micro: float, replicas: int,
                       stride: int, staged: bool = False, itemsize: int = 2, forward_share: float = 1 / 3,
                       groups: int = 1, groups_stride: int | None = None, slowdown: float | None = None) -> float:
    """Seconds a step spends on the data-parallel group's collectives that the backward does not hide: ``grads``
    bytes of a stage's gradients over ``replicas`` ranks ``stride`` apart, ``m`` micro-batches of ``micro`` seconds.

    ZeRO 0 all-reduces them under the last backward, and 1 reduce-scatters there and all-gathers the updated weights
    under the next step's first forward, as Megatron-Core does -- its gradients in fp32 (``memory.MAIN_GRAD_BYTES``:
    twice a bf16 gradient's bytes), a layer's chunk of each exposed (with hybrid sharding its all-reduce across the
    groups too); 2
    reduce-scatters every micro-batch; 3 is FSDP: every layer's weights (``unit`` bytes) gathered for its forward
    and again for its backward, its gradients scattered, every micro-batch -- one collective a layer each, so
    thousands of ranks pay thousands of hops a layer; the next layer's prefetched under this one's compute, but the
    first gather and the last scatter of a micro-batch have nothing to hide behind. ``staged``: ZeRO-3 inside
    pipeline stages is FSDP as torchtitan runs it there (``memory.weight_state_bytes``): each layer gathered once a
    step, under the first micro-batch's forward, and scattered once, under the last one's backward. FSDP reduces the
    gradients in fp32 (torchtitan's ``mixed_precision_reduce = "float32"``, FSDP's ``MixedPrecision(reduce_dtype=
    torch.float32)``). ``forward_share``: the forward's part of ``micro`` (a quarter under full recomputation).

    ``groups`` > 1: hybrid sharding (FSDP2's HSDP, MiCS, MindSpore's ``optimizer_weight_shard_size``): ZeRO shards
    over ``replicas`` consecutive ranks and replicates across ``groups`` such groups, ``replicas x stride`` ranks
    apart, whose gradient shards are all-reduced after each reduce-scatter (FSDP2 all-reduces a unit's shard as soon
    as it is scattered) -- the shard groups' collectives stay on fewer ranks, often one node's NVLink.
    ``groups_stride``: how far apart the groups lie where they are not consecutive (the data-parallel replicas of
    a context group shard a pipeline stage's optimizer in autopar's runtime: ``t x cp`` apart, the groups ``t``).
    ``slowdown``: the compute's beside a hidden collective (``behind``; the cluster's own where None, 0 for what
    sticks out alone)."""
    ar = lambda kind, nbytes: spec.collective(kind, nbytes, replicas, stride)[0]  # noqa: E731
    slowdown = spec.overlap_slowdown if slowdown is None else slowdown
    hide = lambda comm, window: behind(comm, window, slowdown)  # noqa: E731
    across = lambda nbytes: spec.collective("all_reduce", nbytes / replicas, groups,
                                            groups_stride or stride * replicas)[0] \
        if groups > 1 else 0.0  # noqa: E731 -- a shard's gradients over the replica groups
    backward_last = micro * (1 - forward_share)
    main = grads / itemsize * MAIN_GRAD_BYTES
    if zero == 0:
        return hide(ar("all_reduce", main), backward_last)
    if zero == 1:  # Megatron-Core's distributed optimizer with --overlap-grad-reduce --overlap-param-gather: the
        # gradients reduce-scattered a layer's bucket at a time under the last backward, the updated weights
        # gathered a layer at a time under the next step's first forward -- "This overlap method exposes only one
        # DP communication chunk" (NeMo's communication-overlap guide): a layer's
        chunk = unit / itemsize * MAIN_GRAD_BYTES
        return (hide(ar("reduce_scatter", main) + across(main), backward_last) + ar("reduce_scatter", chunk)
                + across(chunk) + hide(ar("all_gather", grads), micro * forward_share) + ar("all_gather", unit))
    rest = max(0.0, grads - layers * unit)  # the embedding and the head: a unit each
    reduced = REDUCE_BYTES / itemsize  # FSDP reduces the gradients in fp32 (memory.REDUCE_BYTES)
    gathers = layers * ar("all_gather", unit) + ar("all_gather", rest)
    scatters = (layers * (ar("reduce_scatter", unit * reduced) + across(unit * reduced))
                + ar("reduce_scatter", rest * reduced) + across(rest * reduced))
    exposed = ar("all_gather", unit) + ar("reduce_scatter", unit * reduced) + across(unit * reduced)
    forward, backward = micro * forward_share, micro * (1 - forward_share)
    if staged and zero == 3:
        return hide(gathers, forward) + hide(scatters, backward) + exposed
    if zero == 2:
        return m * hide(ar("reduce_scatter", grads) + across(grads), backward) + ar("all_gather", grads)
    # each phase hides what it can: the forward's gathers under the forward, the backward's gathers and scatters
    # (a recomputed forward reuses the backward's gather) under the backward
    return m * (hide(gathers, forward) + hide(gathers + scatters, backward) + exposed)
