"""AUTO_PARALLEL's pipeline candidates for a live network: where to cut it, how many micro-batches, what it costs.

A network can be cut between its top-level children (the cells its forward calls in order -- ``nn.Sequential``'s
items, a model's ``layer1``, ``layer2`` ...): the engine (:class:`autopar.parallel.pipeline.PipelineParallel`)
splits before a named module. For every stage count ``S`` dividing the devices (``D = n / S`` data-parallel replicas
of each stage) and every micro-batch count ``M >= S`` dividing the replica's batch, the children are partitioned
into ``S`` consecutive stages of balanced compute (an exact min-max partition), and the step is costed as 1F1B runs
it:

- ``(M + S - 1)`` slots of the slowest stage's forward + backward on one micro-batch, plus the boundary activation
  sent forward and its gradient sent back (a point-to-point copy, costed as a 2-rank all-gather), plus the engine's
  own cost per slot (``MachineModel.pipeline_slot_seconds``, measured: ~1.9 ms over gloo here);
- the stage's gradients all-reduced over its ``D`` replicas after the flush, and the optimizer step over its
  parameters;
- memory: the stage's weights, gradients and optimizer state whole, and the activations of the micro-batches in
  flight (1F1B: ``S - s`` at stage ``s``).

The stages are balanced on the operators' data-parallel costs; each slot is the roofline of its operators again at
the micro-batch size ``B / (D M)`` -- every micro-batch streams the stage's weights whole, so small micro-batches
turn memory-bound (on this CPU machine that is what makes pipelines lose: ``bench/sharding.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from autopar.planner.costs import OPTIMIZER_SLOTS, nbytes


@dataclass
class PipelineOption:
    stages: int
    replicas: int
    micro_batches: int
    micro_batch_size: int
    split_points: list[str]
    stage_names: list[list[str]]  # the top-level children of each stage
    slot: float  # seconds of the slowest stage's forward + backward (+ boundary copies) per micro-batch
    compute: float
    comm: float
    memory: float
    bubble: float = field(init=False)

    def __post_init__(self):
        self.bubble = (self.stages - 1) / (self.micro_batches + self.stages - 1)

    @property
    def step(self) -> float:
        return self.compute + self.comm

    def describe(self) -> str:
        cut = ", ".join(f"'{p}'" for p in self.split_points)
        return (f"pipeline {self.stages} stages x {self.replicas} replica{'s' if self.replicas > 1 else ''}, "
                f"{self.micro_batches} micro-batches of {self.micro_batch_size}, split before {cut}, bubble "
                f"{self.bubble:.0%}: step {self.step * 1e3:.1f} ms = compute {self.compute * 1e3:.1f} + communication "
                f"{self.comm * 1e3:.1f}; memory {self.memory / 2**20:.1f} MiB per device")


@dataclass
class _Unit:
    """One top-level child with the graph nodes it runs (in forward order), each with its data-parallel costs."""
    name: str
    ops: list = field(default_factory=list)  # (node, its data-parallel Choice)
    fb: float = 0.0  # forward + backward seconds, data-parallel on n devices (what the stages are balanced on)
    param_bytes: float = 0.0
    activation_bytes: float = 0.0
    out_bytes: float = 0.0  # its last operator's output on the global batch

    def micro_seconds(self, machine, fraction: float, device_num: int) -> float:
        """Forward + backward on ``fraction`` of the global batch: the roofline again at that size -- the weights
        are streamed whole for every micro-batch, so small micro-batches are memory-bound -- and never less than
        the data-parallel costs (operators timed on this job's device at 1/n of the batch, where a timer ran)
        scaled to the micro-batch: the roofline alone predicted the wide MLP's 2-stage pipeline 5x fast."""
        total = 0.0
        for node, choice in self.ops:
            kind = {"conv": "conv", "softmax": "other"}.get(node.kind, "matmul")
            acts = sum(nbytes(shape, node.itemsize) for shape, name in zip(node.shapes, node.param_names)
                       if name is None) + nbytes(node.out_shape, node.itemsize)
            total += machine.compute(kind, 3.0 * node.flops * fraction, 3.0 * (choice.param_bytes + acts * fraction))
        return max(total, self.fb * fraction * device_num)


def _units(network: torch.nn.Module, problem, dp: list[int]) -> tuple[list[_Unit], str | None]:
    children = dict(network.named_children())
    units: list[_Unit] = []
    for k, node in enumerate(problem.graph.nodes):
        top = node.name.split(".")[0]
        if top not in children:
            return [], f"operator '{node.name}' runs outside the network's cells: there is no cell to cut before"
        if not units or units[-1].name != top:
            if any(u.name == top for u in units):
                return [], f"cell '{top}' runs twice, between other cells: the forward is not a chain of cells"
            units.append(_Unit(top))
        c = problem.costs[k].choices[dp[k]]
        u = units[-1]
        u.ops.append((node, c))
        u.fb += c.compute - c.optimizer
        u.param_bytes += c.param_bytes
        u.activation_bytes += c.activation_bytes
        u.out_bytes = math.prod(node.out_shape) * node.itemsize
    return units, None


def _partition(weights: list[float], parts: int) -> list[int]:
    """Start index of each of ``parts`` consecutive groups minimising the largest group sum (exact DP)."""
    k = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (k + 1) for _ in range(parts + 1)]
    cut = [[0] * (k + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for p in range(1, parts + 1):
        for end in range(p, k + 1):
            for start in range(p - 1, end):
                value = max(best[p - 1][start], prefix[end] - prefix[start])
                if value < best[p][end]:
                    best[p][end], cut[p][end] = value, start
    starts, end = [], k
    for p in range(parts, 0, -1):
        starts.append(cut[p][end])
        end = cut[p][end]
    return starts[::-1]


def fits(option: PipelineOption, limit: float | None) -> bool:
    return limit is None or option.memory <= limit


def _better(a: PipelineOption, b: PipelineOption, limit: float | None) -> bool:
    if fits(a, limit) != fits(b, limit):
        return fits(a, limit)
    return a.step < b.step if fits(a, limit) else a.memory < b.memory


def pipeline_options(network: torch.nn.Module, problem, dp: list[int], device_num: int, global_batch: int,
                     other_compute: float, other_param_bytes: float) -> tuple[list[PipelineOption], str | None]:
    """For every stage count, the fastest option (over micro-batch counts) that fits the memory limit -- or, if
    none does, the one needing least memory; or why the network cannot be cut."""
    if device_num < 2 or dp is None:
        return [], None
    units, why = _units(network, problem, dp)
    if why:
        return [], why
    machine = problem.machine
    fused = machine.optimizer_rate("fused")
    out = []
    for stages in (s for s in range(2, device_num + 1) if device_num % s == 0 and s <= len(units)):
        replicas = device_num // stages
        if global_batch % replicas:
            continue
        per_replica = global_batch // replicas
        starts = _partition([u.fb for u in units], stages)
        groups = [units[a:b] for a, b in zip(starts, starts[1:] + [len(units)])]
        best = None
        for micro in (m for m in range(stages, per_replica + 1) if per_replica % m == 0):
            scale = device_num / (replicas * micro)  # a micro-batch vs the B / n the costs were taken on
            fraction = 1.0 / (replicas * micro)  # of the global batch
            p2p = max((2 * machine.collective("all_gather", 2 * g[-1].out_bytes * fraction, 2)
                       for g in groups[:-1]), default=0.0)
            slot = (max(sum(u.micro_seconds(machine, fraction, device_num) for u in g) for g in groups) + p2p
                    + machine.pipeline_slot_seconds)
            params = [sum(u.param_bytes for u in g) + other_param_bytes / stages for g in groups]
            sync = max(machine.collective("all_reduce", p, replicas) for p in params) if replicas > 1 else 0.0
            optimizer = max(params) / fused
            memory = max(params[s] * (2 + OPTIMIZER_SLOTS)
                         + sum(u.activation_bytes for u in g) * scale * min(micro, stages - s)
                         for s, g in enumerate(groups))
            option = PipelineOption(stages, replicas, micro, per_replica // micro, [g[0].name for g in groups[1:]],
                                    [[u.name for u in g] for g in groups], slot,
                                    (micro + stages - 1) * (slot - p2p) + optimizer + other_compute,
                                    (micro + stages - 1) * p2p + sync, memory)  # the engine's overhead as compute
            if best is None or _better(option, best, problem.memory_limit):
                best = option
        if best is not None:
            out.append(best)
    return out, None
