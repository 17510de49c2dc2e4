"""``plan_network``: from a network (and its loss and a sample batch) to a chosen, explained, applicable plan."""
from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from autopar import context as _context
from autopar.errors import AutoparError, StrategyError
from autopar.layout.layout import Layout
from autopar.ops.shard import has_strategies
from autopar.planner.costs import OPTIMIZER_SLOTS, NodeCosts, charge_attention, graph_costs, spread_between
from autopar.planner.fsdp_timer import fsdp_seconds, zero_groups
from autopar.planner.graph import Graph, capture
from autopar.planner.machine import MachineModel, shared_memory_on
from autopar.planner.pipeline_plan import PipelineOption, fits, pipeline_options
from autopar.planner.search import Problem, search

DDP_BUCKET_BYTES = 25 * 2**20
# A pipeline replaces a plan that fits only when predicted at least this much faster: its per-micro-batch costs are
# the least certain part of the model here (bench/sharding.py, 33.6M MLP on 2 CPU ranks: predicted 0.51x data
# parallel's step, measured 1.08x), and a wrong cut costs a whole training run. Where nothing else fits, it is chosen.
PIPELINE_MARGIN = 0.75


@dataclass
class Totals:
    compute: float
    comm: float  # exposed communication
    memory: float
    measured: str = ""  # how the step was measured whole on the job's devices, where it was (not summed from parts)

    @property
    def step(self) -> float:
        return self.compute + self.comm


class Variant(NamedTuple):
    """A way of dividing the batch other than data parallel's (:mod:`autopar.planner.dimensions`): the sequence
    split over ``cp`` ranks with attention met as ``algo`` (``context_parallel_algo``) says, or the stacked experts
    split by expert (``ep``)."""
    cp: int
    ep: bool
    totals: Totals
    algo: str = "all_gather"


@dataclass
class Plan:
    graph: Graph
    costs: list[NodeCosts]
    problem: Problem
    choice: list[int]
    device_num: int
    search_mode: str
    search_seconds: float
    totals: Totals
    dp_totals: Totals | None
    pure_data_parallel: bool
    reason: str
    zero: dict = None  # ZeRO level -> Totals of data parallel with that level of optimizer sharding
    zero_level: str | None = None  # chosen: data parallel on FSDP2 with this level (pure_data_parallel is True)
    pipelines: list = field(default_factory=list)  # PipelineOption per stage count
    pipeline_note: str | None = None  # why no pipeline was weighed
    pipeline: PipelineOption | None = None  # chosen: the network cut into stages (Model.train runs it)
    trials: list = field(default_factory=list)  # the measured round: (plan name, predicted s, measured s), chosen first
    dp_step_key: str | None = None  # where data parallel's step measured whole is cached (the round's goes beside it)
    cached: str | None = None  # the plan file this decision was read from (a restart plans no more)
    memory_limit: float | None = None  # per device, as asked (``problem`` may be the unlimited one: ZeRO's path)
    other_compute: float | None = None  # per device, of everything outside the nodes (measured in a job)
    in_training: tuple | None = None  # (seconds per step, steps): the job's first steps after the plan, timed
    # planning's seconds beside capture and search: measuring the costs, and the measured round (fields, so that a
    # runner-up the round keeps -- a dataclasses.replace of this plan -- still says them)
    cost_seconds: float = 0.0
    trial_seconds: float = 0.0
    # the batch divided otherwise (autopar.planner.dimensions): chosen -- the sequence split over this many ranks
    # (1: none) with attention met as ``context_parallel_algo`` says, the stacked experts split by expert -- and
    # weighed: label -> Variant
    context_parallel: int = 1
    expert_parallel: bool = False
    variants: dict = field(default_factory=dict)
    context_parallel_algo: str = "all_gather"

    @property
    def plain_data_parallel(self) -> bool:
        """Data parallel on DDP as it is: no ZeRO, no pipeline, no sequence or expert split."""
        return (self.pure_data_parallel and self.zero_level is None and self.pipeline is None
                and self.context_parallel == 1 and not self.expert_parallel)

    def chosen(self, n: int):
        return self.costs[n].choices[self.choice[n]]

    # -- running it -------------------------------------------------------------------------------------------
    def strategies(self) -> list[tuple[torch.nn.Module, tuple]]:
        """``(operator or module, strategy)`` for every operator the search chose (one a user annotated is left
        out): what ``autopar.shard`` applies -- the strategies a user could have written. Empty for pure data
        parallel and for a pipeline; the modules of stacked experts marked ``"expert"`` where the experts are
        split."""
        marks = [(module, "expert") for module, *_ in self.graph.experts] if self.expert_parallel else []
        if self.pipeline is not None or self.pure_data_parallel:
            return marks
        out = marks
        for node, n in zip(self.graph.nodes, range(len(self.choice))):
            if node.fixed is None:
                strategy = self.chosen(n).strategy
                out.append((node.target, strategy[:2] if node.kind in ("linear", "conv") else strategy))
        return out

    def layouts(self) -> dict[str, Layout]:
        out = {}
        for n, node in enumerate(self.graph.nodes):
            plan = self.chosen(n).plan
            for i, name in enumerate(node.param_names):
                if name is not None:
                    out[name] = plan.inputs[i]
        return out

    # -- explaining it ------------------------------------------------------------------------------------------
    def explain(self) -> str:
        rows = []
        for n, node in enumerate(self.graph.nodes):
            c = self.chosen(n)
            comm = self.costs[n].comm(c, self.problem.machine)
            rows.append((node.name, node.kind, node.shapes_text(), str(c.strategy), c.label, c.compute * 1e3, comm * 1e3,
                         c.memory / 2**20))
        widths = [max(len(str(r[i])) for r in rows + [("operator", "kind", "shapes", "strategy", "layout")])
                  for i in range(5)]
        head = (f"{'operator':<{widths[0]}}  {'kind':<{widths[1]}}  {'shapes':<{widths[2]}}  {'strategy':<{widths[3]}}  "
                f"{'layout':<{widths[4]}}  {'compute ms':>10}  {'comm ms':>8}  {'mem MiB':>8}")
        lines = [f"AUTO_PARALLEL plan on {self.device_num} devices ({self.search_mode}, search {self.search_seconds:.3f}"
                 f" s, graph capture {self.graph.seconds:.2f} s, costs {self.cost_seconds:.2f} s); machine: {self.problem.machine.source}", head]
        for r in rows:
            lines.append(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:<{widths[3]}}  "
                         f"{r[4]:<{widths[4]}}  {r[5]:>10.2f}  {r[6]:>8.2f}  {r[7]:>8.1f}")
        between = getattr(self.problem, "between", 0.0)
        if between:
            how = "measured: the data-parallel step whole, less its timed operators" if getattr(
                self.problem, "between_measured", False) else "the roofline of their element-wise FLOPs"
            lines.append(f"between the operators (normalisations, activations, residual adds, the loss): "
                         f"{between * 1e3:.1f} ms per step under data parallel ({how}); in the compute column, "
                         f"each operator's share as split as its output")
        t = self.totals
        layout = not self.pure_data_parallel and self.pipeline is None
        dispatch = dispatch_of(self.problem) if layout else 0.0
        sums = getattr(self.problem, "other_sums", 0.0) if layout else 0.0
        lines.append(f"plan total: step {t.step * 1e3:.1f} ms = compute {t.compute * 1e3:.1f}"
                     + (f" (of which DTensor dispatch {dispatch * 1e3:.1f}: {self.graph.tensor_calls} operators x 3)"
                        if dispatch else "")
                     + f" + communication {t.comm * 1e3:.1f}"
                     + (f" (of which {sums * 1e3:.1f}: the gradients of the parameters outside the operators, "
                        "summed one at a time)" if sums else "")
                     + f"; memory {t.memory / 2**20:.1f} MiB per device"
                     + (f" (limit {self.problem.memory_limit / 2**20:.1f})" if self.problem.memory_limit else ""))
        if self.dp_totals is not None:
            d = self.dp_totals
            lines.append(f"data parallel: step {d.step * 1e3:.1f} ms = compute {d.compute * 1e3:.1f} + exposed "
                         f"communication {d.comm * 1e3:.1f}; memory {d.memory / 2**20:.1f} MiB per device"
                         + (f" (the step measured whole: {d.measured})" if d.measured else ""))
            for level, z in (self.zero or {}).items():
                lines.append(f"data parallel + ZeRO {level} ({ZERO_WHAT[level]} sharded over {self.device_num}): "
                             f"step {z.step * 1e3:.1f} ms = compute {z.compute * 1e3:.1f} + exposed communication "
                             f"{z.comm * 1e3:.1f}; memory {z.memory / 2**20:.1f} MiB per device")
        else:
            lines.append("data parallel: not possible for this network on this many devices")
        for label, (_, _, v, _) in self.variants.items():
            lines.append(f"{label}: step {v.step * 1e3:.1f} ms = compute {v.compute * 1e3:.1f} + communication "
                         f"{v.comm * 1e3:.1f}; memory {v.memory / 2**20:.1f} MiB per device")
        for option in self.pipelines:
            lines.append(option.describe() + ("" if fits(option, self.problem.memory_limit) else " (does not fit)"))
        if self.pipeline_note:
            lines.append(f"pipeline: not weighed -- {self.pipeline_note}")
        if self.trials:
            lines.append("measured round (each plan a few steps on this job's devices, the slowest rank's median "
                         "step; the fastest is kept):")
            width = max(len(name) for name, _, _ in self.trials)
            for name, predicted, measured in self.trials:
                error = f"{100 * (predicted - measured) / measured:+.0f}%" if measured < float("inf") else ""
                shown = f"{measured * 1e3:9.1f} ms" if measured < float("inf") else "   failed"
                lines.append(f"  {name:<{width}}  predicted {predicted * 1e3:9.1f} ms  measured {shown}  {error}")
        if self.cached:
            lines.append(f"(decision read from {self.cached}: the same network, world and backend were planned before)")
        lines.append(f"chosen: {self.reason}")
        if self.in_training:
            lines.append(training_line(self))
        return "\n".join(lines)


def training_line(plan: Plan) -> str:
    """Predicted against measured for the plan that ran: its first steps in training (``Plan.in_training``)."""
    measured, steps = plan.in_training
    predicted = plan.totals.step
    return (f"in training: {measured * 1e3:.1f} ms per step (median of {steps} after the first), predicted "
            f"{predicted * 1e3:.1f} ms ({100 * (predicted - measured) / measured:+.0f}%)")


def params_outside(network: torch.nn.Module, graph: Graph) -> list[torch.nn.Parameter]:
    """The network's parameters that no node of the graph holds (normalisations' weights and biases, ...)."""
    covered = {p for node in graph.nodes for p in node.param_names if p}
    return [p for n, p in network.named_parameters() if n not in covered]


def other_param_bytes(network: torch.nn.Module, graph: Graph) -> float:
    return float(sum(p.numel() * p.element_size() for p in params_outside(network, graph)))


def other_compute_of(plan: "Plan") -> float:
    """The compute of everything outside the graph's nodes (data-parallel), per device."""
    if plan.other_compute is not None:
        return plan.other_compute
    return plan.problem.machine.compute("other", 3.0 * plan.graph.other_flops / plan.device_num)


def _other_compute(network, loss_fn, sample: tuple, kwargs: dict | None, graph: Graph, costs: list[NodeCosts],
                   machine: MachineModel) -> tuple[float, bool]:
    """(seconds, measured): what a step computes outside the graph's nodes, per device. In a job (the machine model
    carries an operator timer) the data-parallel step measured whole less its timed operators
    (:func:`op_timer.whole_step_seconds`); otherwise, or where the step cannot be measured, the roofline of the
    element-wise FLOPs the capture counted."""
    from autopar.planner.graph import with_loss
    from autopar.planner.op_timer import whole_step_seconds

    n = costs[0].device_num if costs else 1
    roofline = machine.compute("other", 3.0 * graph.other_flops / n)
    timer = getattr(machine, "op_timer", None)
    operators = [nc.dp_compute for nc in costs]
    if timer is None or None in operators or built_on_meta(network):
        return roofline, False
    whole = whole_step_seconds(timer, "step " + _step_digest(network, loss_fn, graph, n), with_loss(network, loss_fn),
                               sample, kwargs or {}, n)
    return (roofline, False) if whole is None else (max(roofline, whole - sum(operators)), True)


class MetaTraceError(Exception):
    """A meta-built network's forward that meta tensors cannot trace (a size set by values: a mixture of experts'
    routing); the message says why. The caller builds the network whole and plans it as an eager one."""


def built_on_meta(network: torch.nn.Module) -> bool:
    """Are ``network``'s parameters still on the meta device -- built to be initialised sharded (``deferred_init``,
    ``no_init_parameters``, ``torch.device("meta")``), nothing made yet? Then it is planned as it is: traced on
    meta tensors, its operators timed on inputs of their shapes, and nothing that runs the network itself (its step
    measured whole, data parallel's or ZeRO's on a copy) -- that would build it whole on every rank."""
    return any(p.is_meta for p in network.parameters())


@contextlib.contextmanager
def _all_on_meta(*modules):
    """For the trace of a meta-built network: its buffers and the parameters already made (frozen ones, made whole
    by :func:`autopar.parallel.api._prepare_deferred`) stand on the meta device beside the rest, and are put back
    as they were afterwards -- the same tensor objects, untouched; and the trace's call of it makes nothing real
    (:func:`autopar.common.deferred.calls_keep_meta`: a first call outside a parallel runtime makes a recorded
    network whole)."""
    from autopar.common import deferred

    roots = [m for m in modules if isinstance(m, torch.nn.Module)]
    with deferred.calls_keep_meta(), deferred.swapped(roots, lambda t: not t.is_meta, lambda t: t.detach().to("meta")):
        yield


@contextlib.contextmanager
def _routing_known(network: torch.nn.Module):
    """For the trace of a meta-built network: a mixture of experts' routing gets values, so the sizes it sets (the
    tokens each expert takes: ``where``, ``nonzero``) are known -- each module of stacked experts (Hugging Face's
    ``MixtralExperts`` form, ``forward(hidden_states, top_k_index, top_k_weights)``) is handed a uniform routing on
    the host in place of the meta router's choice (the same on every rank: every rank plans alike), what is computed
    from it alone runs on the host, and an operator that meets it beside meta tensors takes it as a meta tensor of
    its shape. The experts' work is then traced as a load-balanced router sends it."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_map

    from autopar.layout.leaves import stacked_experts, uniform_routing

    def routed(module, args):
        index = args[1] if len(args) >= 3 else None
        if not (isinstance(index, torch.Tensor) and index.is_meta and index.dim() == 2
                and not index.is_floating_point() and index.dtype != torch.bool
                and index.shape[-1] <= module.num_experts):
            return None
        return (args[0], uniform_routing(index.shape[0], module.num_experts, index.shape[1], index.dtype, 0),
                *args[2:])

    def on_meta(tree):
        return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) and t.dim() > 0 else t, tree)

    class MetaBesideHost(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if any(t.is_meta for t in leaves):
                args, kwargs = on_meta((args, kwargs))
                return func(*args, **kwargs)
            try:
                return func(*args, **kwargs)
            except (RuntimeError, NotImplementedError):  # a kernel the host lacks for the routing's dtype (histc
                # of integers, which the model chose because its hidden states are not on the CPU): its values
                # stay unknown
                return func(*on_meta(args), **on_meta(kwargs))

    handles = [m.register_forward_pre_hook(routed) for m in network.modules() if stacked_experts(m)]
    try:
        with MetaBesideHost() if handles else contextlib.nullcontext():
            yield
    finally:
        for h in handles:
            h.remove()


def _to_meta(tree):
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, tree)


def _step_digest(network, loss_fn, graph: Graph, n: int) -> str:
    """What identifies a network's whole step in the operator cache: its graph's shapes, its classes, n, dtype."""
    import hashlib

    shapes = [[node.name, node.kind, [list(s) for s in node.shapes]] for node in graph.nodes]
    return hashlib.sha1(repr((shapes, type(network).__name__, type(loss_fn).__name__, n,
                              str(next(network.parameters(), torch.empty(0)).dtype))).encode()).hexdigest()


def _zero_whole(network, loss_fn, sample: tuple, kwargs: dict | None, graph: Graph, machine: MachineModel,
                n: int) -> dict | None:
    """The network's ZeRO step per level, measured whole in a job (None elsewhere)."""
    from autopar.planner.fsdp_timer import zero_step_seconds
    from autopar.planner.graph import with_loss

    if getattr(machine, "op_timer", None) is None or n < 2 or built_on_meta(network):
        return None
    return zero_step_seconds(machine, "zero step " + _step_digest(network, loss_fn, graph, n),
                             with_loss(network, loss_fn), sample, kwargs or {}, n)


def dispatch_of(p: Problem) -> float:
    """A layout's DTensor dispatch: every operator of the forward, and about twice as many in the backward."""
    return 3.0 * p.graph.tensor_calls * (p.machine.dispatch_seconds or 0.0)


def totals_of(p: Problem, choice: list[int], other_compute: float) -> Totals:
    operators = sum(p.costs[n].choices[s].compute for n, s in enumerate(choice))
    return Totals(other_compute + dispatch_of(p) + operators,
                  p.total(choice) - operators + getattr(p, "other_sums", 0.0), p.used_memory(choice))


def other_param_sums(network: torch.nn.Module, graph: Graph, machine: MachineModel, device_num: int) -> float:
    """Seconds a layout spends each step summing, one at a time, the gradients of the parameters outside the
    operators it places (normalisations' weights and biases): replicated DTensors whose gradients are partial sums
    wherever the work around them runs split, each made whole by its own all-reduce in the backward -- no bucket.

    Why: unpriced, ResNet-50's layouts on 2 ranks were predicted 20-40 % fast. Traced in their steps, DTensor ran
    ~100 of these all-reduces (~1.4 ms each here, 0.13-0.15 s a step); the transformer and Llama blocks' layouts,
    Megatron's included, run one per norm parameter too (3-9 ms a step). Priced as the runtime runs them:
    DTensor's redistribution of the parameter, its backward from a partial gradient, measured in a job
    (:func:`autopar.planner.costs.reshard_cost`), one measurement per shape."""
    if device_num < 2:
        return 0.0
    from torch.distributed.tensor import Partial

    from autopar.layout.axes import mesh_shape_for
    from autopar.planner.costs import nbytes, rep_placements, reshard_cost

    mesh = mesh_shape_for(device_num)
    priced: dict[tuple, float] = {}
    total = 0.0
    for param in params_outside(network, graph):
        if not param.requires_grad:
            continue
        key = (tuple(param.shape), param.element_size())
        if key not in priced:  # (outside a job, nothing measured: the all-reduce's alpha-beta model)
            priced[key] = reshard_cost(machine, rep_placements(mesh), rep_placements(mesh), nbytes(*key), mesh,
                                       key[0], key[1], tuple(Partial() for _ in mesh)) \
                or machine.collective("all_reduce", nbytes(*key), device_num)
        total += priced[key]
    return total


ON_A_COPY = "the runtime's data parallel on a copy"
BY_THE_ROUND = "the runtime's data parallel as a measured round ran it"
ROUND_SUFFIX = " measured round"  # the cache key of the measured round's step: the copy's key and this


def _dp_step_key(measure, network, loss_fn, graph: Graph, n: int) -> str:
    """The cache key of data parallel's step measured whole: per network, world size and what else changes it
    (``measure.key()``: the runtime's bucket size, shared memory)."""
    return f"data-parallel step {_step_digest(network, loss_fn, graph, n)} {measure.key()}"


def _dp_whole(measure, network, loss_fn, sample: tuple, kwargs: dict | None, graph: Graph, machine: MachineModel,
              n: int) -> tuple[float, str] | None:
    """(seconds, how) of data parallel's step measured whole in a job (None where there is none, outside a job, or
    where the copy cannot step), agreed by the ranks and cached with the operators: the step a measured round timed
    (:func:`record_data_parallel_step`; this job's or an earlier one's) where there is one, else the runtime's
    ``measure`` of it on a copy -- and where both were measured, the faster.

    Why the faster: both time the same step on a heap other than training's, and what they meet there only slows
    them. The wide MLP's data parallel on 2 ranks, timed by the round after nine layouts: 0.52 s (the copy: 0.20,
    its own job: 0.17-0.19); on 4 ranks the copy 0.52 s where the round gave 0.44 and the job 0.40."""
    from autopar.planner.graph import with_loss

    timer = getattr(machine, "op_timer", None)
    if measure is None or timer is None or n < 2 or built_on_meta(network):
        return None
    key = _dp_step_key(measure, network, loss_fn, graph, n)
    by_round = timer.agreed(key + ROUND_SUFFIX, _not_measured_here)  # (every rank has it, or none uses it)
    if by_round is not None:
        on_copy = timer.agreed(key, _not_measured_here)
        # the faster of the two: what slows either (a heap left by other plans, a busy neighbour) only adds time
        if on_copy is not None and on_copy[0] < by_round[0]:
            return on_copy[0], ON_A_COPY
        return by_round[0], BY_THE_ROUND
    measured = timer.agreed(key, lambda: measure(timer, with_loss(network, loss_fn), sample, kwargs or {}, n))
    return None if measured is None else (measured[0], ON_A_COPY)


def _not_measured_here() -> tuple:
    raise LookupError("only a measured round records this")


def record_data_parallel_step(plan: "Plan", seconds: float) -> bool:
    """Keep data parallel's step as a measured round timed it (the runtime itself, on the job's devices, stepped
    back to back as training steps) beside the copy's measurement: a later plan of this network in a job -- a
    restart, the network planned again -- predicts data parallel with it, or with the copy's where that was
    faster (:func:`_dp_whole`). True if kept. Every rank calls it with the
    same ``seconds`` (the round's times are agreed). The round's time is the median of its few steps and is kept
    until the cache is cleared (a decision read back runs no round).

    Why: the copy is stepped with a barrier before each step, on a heap the planner's other measurements left, and
    on 4 ranks of this 2-core host the wide MLP's data parallel measured 0.60-0.62 s that way in four jobs, where
    training ran it at 0.43-0.50 s and the measured round at 0.525 s (``bench/auto_vs_hand.py``); elsewhere the two
    agreed within 8 %."""
    timer = getattr(plan.problem.machine, "op_timer", None)
    if timer is None or plan.dp_step_key is None or not 0 < seconds < float("inf"):
        return False
    timer.keep(plan.dp_step_key + ROUND_SUFFIX, (seconds, seconds))
    timer.save()
    return True


def _dp_totals(p: Problem, dp: list[int], other_compute: float, other_grad_bytes: float,
               whole: tuple[float, str] | None = None) -> Totals:
    """Pure data parallel on DDP: gradients all-reduced in buckets while the backward pass runs. ``whole``: the step
    measured whole (:func:`_dp_whole`): where given, the step is that, its communication what it takes beyond the
    compute."""
    machine, n = p.machine, p.costs[0].device_num
    grad_bytes = other_grad_bytes + sum(
        p.costs[k].choices[s].plan.inputs[i].slice_shape and
        math.prod(p.costs[k].choices[s].plan.inputs[i].slice_shape) * p.graph.nodes[k].itemsize
        for k, s in enumerate(dp) for i, name in enumerate(p.graph.nodes[k].param_names) if name)
    buckets = max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))
    # on one CPU host the float32 gradients are summed through shared memory, where that was calibrated
    kind = "host_all_reduce" if "host_all_reduce" in machine.collectives and shared_memory_on() and all(
        p.graph.nodes[k].itemsize == 4 for k in range(len(dp))) else "all_reduce"
    allreduce = buckets * machine.collective(kind, grad_bytes / buckets, n)
    fused = machine.optimizer_rate("fused")  # DDP's parameters are plain tensors: the fused optimizer kernel
    compute = other_compute + sum(p.costs[k].choices[s].compute - p.costs[k].choices[s].optimizer
                                  + p.costs[k].choices[s].param_bytes / fused for k, s in enumerate(dp))
    backward = sum(p.costs[k].choices[s].backward for k, s in enumerate(dp))
    others = sum(p.costs[k].choices[s].act_comm + p.costs[k].boundary_cost(p.costs[k].choices[s], machine)
                 for k, s in enumerate(dp))
    if whole is not None:
        seconds, how = whole
        return Totals(min(compute, seconds), max(0.0, seconds - compute), p.used_memory(dp), measured=how)
    return Totals(compute, allreduce - machine.hidden(allreduce, backward) + others, p.used_memory(dp))


ZERO_WHAT = {"level1": "optimizer state", "level2": "optimizer state and gradients",
             "level3": "optimizer state, gradients and weights"}


def fsdp_groups(network: torch.nn.Module) -> list[float]:
    """The parameter bytes of each FSDP2 group ZeRO makes of ``network`` -- as
    :func:`autopar.parallel.zero.fsdp.shard_optimizer` shards it (:func:`~autopar.planner.fsdp_timer.zero_groups`):
    every module owning trainable parameters of its own is a group, the network the rest (shared parameters, its
    own). Each group gathers and reduce-scatters on its own: a collective's fixed cost and FSDP2's bookkeeping are
    paid per group."""
    groups, grouped = [], set()
    for module in zero_groups(network):
        own = list(module.parameters(recurse=False))
        groups.append(float(sum(p.numel() * p.element_size() for p in own)))
        grouped.update(id(p) for p in own)
    rest = {id(p): p for p in network.parameters() if id(p) not in grouped}
    if rest:
        groups.append(float(sum(p.numel() * p.element_size() for p in rest.values())))
    return groups


def _zero_totals(p: Problem, dp: list[int], dp_totals: Totals, other_params: float,
                 groups: list[float] | None = None, whole: dict | None = None) -> dict[str, Totals]:
    """Data parallel with the optimizer sharded (FSDP2, :mod:`autopar.parallel.zero.fsdp`), per level.

    Memory at the peak of a step: levels 1 and 2 gather every weight for forward and backward (FSDP2 keeps them
    until the backward, ``reshard_after_forward=False``) next to the 1/n slices of weights, gradients and state;
    level 3 holds only the slices plus the largest module's gathered weights and gradient. Time: in a job, what
    FSDP2 adds per group, measured at the job's group sizes (:mod:`autopar.planner.fsdp_timer`); for a machine
    file, every group's weights all-gathered (level 3: again for the backward) and its gradients
    reduce-scattered, each overlapping the pass it serves as far as the machine hides collectives. The optimizer
    step touches 1/n of the parameters. Considered only when plain data parallel does not fit: where it fits, DDP's
    bucketed all-reduce measured faster than FSDP2 on every level (bench/sharding.py). ``groups``: the bytes of
    each FSDP2 group (:func:`fsdp_groups`; one group of all parameters where not given). ``whole``: per level, the
    step of the network itself measured under ZeRO (:func:`~autopar.planner.fsdp_timer.zero_step_seconds`): where
    given, the step is that, and its communication what it takes beyond the compute."""
    machine, n = p.machine, p.costs[0].device_num
    if n <= 1:
        return {}
    chosen = [p.costs[k].choices[s] for k, s in enumerate(dp)]
    params = other_params + sum(c.param_bytes for c in chosen)
    groups = [g for g in (groups or [params]) if g > 0]
    largest = max([c.param_bytes for c in chosen] + [0.0])
    fused = params / machine.optimizer_rate("fused")  # what data parallel's totals hold for the step
    layout = params / machine.optimizer_rate("layout")  # FSDP2's parameters are DTensors: no fused kernel
    backward = sum(c.backward for c in chosen)
    forward = dp_totals.compute - backward - fused
    state = params * (2 + OPTIMIZER_SLOTS)
    others = dp_totals.memory - state  # activations and what is not a parameter
    gather = sum(machine.collective("all_gather", g, n) for g in groups)
    scatter = sum(machine.collective("reduce_scatter", g, n) for g in groups)
    compute = dp_totals.compute - fused + layout / n
    measured = None if whole else fsdp_seconds(machine, groups)  # FSDP2 measured on this job's devices, in a job
    out = {}
    for level in ("level1", "level2", "level3"):
        memory = others + state / n + 2 * largest if level == "level3" else others + params + state / n
        comm = measured[level] if measured else machine.zero_exposed(level, gather, scatter, forward, backward)
        if whole:
            out[level] = Totals(min(compute, whole[level]), max(0.0, whole[level] - compute), memory)
        else:
            out[level] = Totals(compute, comm, memory)
    return out


def _fitting(zero: dict[str, Totals], memory_limit: float | None) -> dict[str, Totals]:
    return {k: z for k, z in zero.items() if memory_limit is None or z.memory <= memory_limit}


def plan_network(network: torch.nn.Module, loss_fn: torch.nn.Module | None, sample: tuple, device_num: int,
                 machine: MachineModel, search_mode: str = "dynamic_programming",
                 memory_limit: float | None = None, pipeline_note: str | None = None,
                 sample_kwargs: dict | None = None, data_parallel_step=None) -> Plan:
    """Capture, cost, search, compare with data parallelism (with and without ZeRO) and pipelines; the result can
    ``apply()`` and ``explain()``. ``pipeline_note``: why pipelines are not to be weighed (a loop that runs its own
    backward cannot run one). ``sample_kwargs``: the network's keyword inputs (``input_ids=...``).
    ``data_parallel_step``: the runtime's measurement of its data-parallel step, called ``(timer, network with loss,
    sample, kwargs, n) -> (seconds, seconds)``, with ``key()`` naming what else changes it
    (:data:`autopar.parallel.data.step_timer.DATA_PARALLEL_STEP`): in a job, data parallel's step is that, measured
    whole (None: summed from its parts)."""
    start = time.perf_counter()
    with _context.side_work():  # the measurements below step optimizers of their own
        plan = _plan_network(network, loss_fn, sample, device_num, machine, search_mode, memory_limit, pipeline_note,
                             sample_kwargs, data_parallel_step)
    # the rest of planning: costing the candidates, inside a job by measuring them (operators, redistributions, the
    # optimizer, the whole step, ZeRO) -- the part of planning a user waits for most, so it is said
    if search_mode != "sharding_propagation" and not any(node.fixed is not None for node in plan.graph.nodes):
        _weigh_dimensions(plan, network, memory_limit)
    plan.cost_seconds = max(0.0, time.perf_counter() - start - plan.graph.seconds - plan.search_seconds)
    plan.memory_limit = memory_limit
    timer = getattr(machine, "op_timer", None)
    if data_parallel_step is not None and plan.dp_totals is not None and plan.dp_totals.measured:
        plan.dp_step_key = _dp_step_key(data_parallel_step, network, loss_fn, plan.graph, device_num)
    if timer is not None:  # what this plan measured (operators, the step, FSDP2's groups), for the next job
        timer.save()
    return plan


def _plan_network(network: torch.nn.Module, loss_fn: torch.nn.Module | None, sample: tuple, device_num: int,
                  machine: MachineModel, search_mode: str = "dynamic_programming",
                  memory_limit: float | None = None, pipeline_note: str | None = None,
                  sample_kwargs: dict | None = None, data_parallel_step=None) -> Plan:
    if built_on_meta(network):  # traced as it is: nothing of its size is made (built_on_meta)
        try:
            with _all_on_meta(network, loss_fn), _routing_known(network):
                graph = capture(network, loss_fn, _to_meta(tuple(sample)), every_operator=search_mode ==
                                "sharding_propagation", kwargs=_to_meta(dict(sample_kwargs or {})))
        except AutoparError:
            raise
        except (RuntimeError, NotImplementedError) as exc:  # (every rank alike, before any collective)
            lines = str(exc).splitlines() or [type(exc).__name__]
            raise MetaTraceError(lines[0].split(". ")[0][:200]) from exc
    else:
        graph = capture(network, loss_fn, sample, every_operator=search_mode == "sharding_propagation",
                        kwargs=sample_kwargs)
    timer = getattr(machine, "op_timer", None)
    rates = timer.optimizer_rates(network, device_num) if timer is not None else None
    if rates:  # the optimizer step timed on this network's own parameters (this plan's copy of the machine)
        machine = copy.copy(machine)
        machine.optimizer_rates = {**(machine.optimizer_rates or {}), **rates}
    if sample_kwargs and pipeline_note is None:
        pipeline_note = "the network takes keyword inputs, which a pipeline's stages do not pass"
    costs = graph_costs(graph, machine, device_num)
    charge_attention(graph, costs, machine, device_num)  # (before: the step measured whole ran it too)
    between, measured = _other_compute(network, loss_fn, sample, sample_kwargs, graph, costs, machine)
    # the work between the operators goes with the operators it follows (as split as their outputs), or -- where
    # that is unknown -- stays one data-parallel constant
    other_compute = 0.0 if spread_between(costs, between) else between
    other_params = other_param_bytes(network, graph)
    const_memory = graph.other_activation_bytes / device_num + other_params * 3
    problem = Problem(graph, costs, machine, const_memory, memory_limit)
    problem.between, problem.between_measured = between, measured
    problem.other_sums = other_param_sums(network, graph, machine, device_num)
    user_given = any(node.fixed is not None for node in graph.nodes)
    dp = problem.dp_choice()
    groups = fsdp_groups(network)
    if user_given:
        pipeline_note = pipeline_note or "the user gave strategies"
    pipelines: list[PipelineOption] = []
    if pipeline_note is None and dp is not None:
        batch = next((t.shape[0] for t in sample if isinstance(t, torch.Tensor) and t.dim()), 0)
        pipelines, pipeline_note = pipeline_options(network, problem, dp, device_num, batch, other_compute,
                                                    other_params)
    best_pipeline = min((o for o in pipelines if fits(o, memory_limit)), key=lambda o: o.step, default=None)
    try:
        choice, seconds = search(problem, search_mode)
    except StrategyError as exc:  # no layout fits: data parallel with its optimizer sharded, or a pipeline, may
        if user_given or dp is None:
            raise
        free = Problem(graph, costs, machine, const_memory, None)
        free.between, free.between_measured = problem.between, problem.between_measured
        free.other_sums = problem.other_sums
        dp_totals = _dp_totals(free, dp, other_compute, other_params)
        zero = _zero_totals(free, dp, dp_totals, other_params, groups,
                            _zero_whole(network, loss_fn, sample, sample_kwargs, graph, machine, device_num))
        fitting = _fitting(zero, memory_limit)
        level = min(fitting, key=lambda k: fitting[k].step, default=None)
        if best_pipeline is not None and (level is None or best_pipeline.step < PIPELINE_MARGIN * fitting[level].step):
            return Plan(graph, costs, free, dp, device_num, search_mode, 0.0, _as_totals(best_pipeline), dp_totals,
                        False, f"{best_pipeline.describe()}: no layout of the operators fits the memory limit ({exc})",
                        zero, None, pipelines, pipeline_note, best_pipeline,
                        other_compute=other_compute)
        if level is None:
            smallest = min(zero.values(), key=lambda z: z.memory)
            leanest = sorted(pipelines, key=lambda o: o.memory)[:1]
            also = "".join(f"; a pipeline of {o.stages} stages needs {o.memory / 2**20:.1f} MiB" for o in leanest)
            raise StrategyError(f"{exc}; data parallel with ZeRO level3 needs {smallest.memory / 2**20:.1f} MiB"
                                f"{also}") from None
        return Plan(graph, costs, free, dp, device_num, search_mode, 0.0, zero[level], dp_totals, True,
                    f"data parallel + ZeRO {level} ({zero[level].step * 1e3:.1f} ms per step): no layout of the "
                    f"operators fits the memory limit ({exc})", zero, level, pipelines, pipeline_note,
                    other_compute=other_compute)
    searched = totals_of(problem, choice, other_compute)
    dp_totals = None
    if dp is not None:
        whole = None
        if not user_given and problem.fits(dp):
            whole = _dp_whole(data_parallel_step, network, loss_fn, sample, sample_kwargs, graph, machine, device_num)
        dp_totals = _dp_totals(problem, dp, other_compute, other_params, whole)
    zero = {}
    if dp is not None and not user_given:  # ZeRO measured whole where it can be chosen or the context asks for it
        live = not problem.fits(dp) or _context.auto_parallel_context().enable_parallel_optimizer
        whole = _zero_whole(network, loss_fn, sample, sample_kwargs, graph, machine, device_num) if live else None
        zero = _zero_totals(problem, dp, dp_totals, other_params, groups, whole)
    totals, pure = searched, dp is not None and choice == dp
    if pure:
        totals = dp_totals
        reason = "the search itself chose data parallel for every operator"
    elif user_given:
        reason = "the searched plan around the strategies the user gave (kept as given)"
    elif dp_totals is not None and problem.fits(dp) and dp_totals.step <= searched.step:
        choice, totals, pure = dp, dp_totals, True
        reason = (f"data parallel ({dp_totals.step * 1e3:.1f} ms per step, its gradient all-reduce overlapped by the "
                  f"backward pass) beats the best sharded plan ({searched.step * 1e3:.1f} ms)")
    elif dp_totals is None:
        reason = "the searched plan (data parallel is not possible here)"
    else:
        why = "does not fit in memory" if not problem.fits(dp) else f"takes {dp_totals.step * 1e3:.1f} ms per step"
        reason = f"the searched plan ({searched.step * 1e3:.1f} ms per step); data parallel {why}"
    level = None
    dp_fits = dp_totals is not None and problem.fits(dp)
    if zero and not dp_fits:  # data parallel does not fit: with its optimizer sharded it may, and beat the layouts
        fitting = _fitting(zero, memory_limit)
        best = min(fitting, key=lambda k: fitting[k].step, default=None)
        chosen_fits = memory_limit is None or totals.memory <= memory_limit
        if best is not None and (fitting[best].step < totals.step or not chosen_fits):
            level, old = best, totals
            choice, totals, pure = dp, fitting[best], True
            why = "does not fit" if not chosen_fits else f"takes {old.step * 1e3:.1f} ms"
            reason = (f"data parallel + ZeRO {best} ({totals.step * 1e3:.1f} ms per step, {totals.memory / 2**20:.1f} "
                      f"MiB per device); without it: {reason}, which {why}")
    chosen_fits = memory_limit is None or totals.memory <= memory_limit
    if best_pipeline is not None and (best_pipeline.step < PIPELINE_MARGIN * totals.step or not chosen_fits):
        why = "does not fit" if not chosen_fits else f"takes {totals.step * 1e3:.1f} ms"
        reason = f"{best_pipeline.describe()}; without it: {reason}, which {why}"
        return Plan(graph, costs, problem, dp, device_num, search_mode, seconds, _as_totals(best_pipeline),
                    dp_totals, False, reason, zero, None, pipelines, pipeline_note, best_pipeline,
                        other_compute=other_compute)
    return Plan(graph, costs, problem, choice, device_num, search_mode, seconds, totals, dp_totals, pure, reason,
                zero, level, pipelines, pipeline_note, other_compute=other_compute)


def _weigh_dimensions(plan: Plan, network: torch.nn.Module, memory_limit: float | None) -> None:
    """Context and expert parallelism beside the plan (:mod:`autopar.planner.dimensions`): each possible variant
    predicted from data parallel's step and listed; the fastest that fits replaces the plan where it is predicted
    faster, or where the plan does not fit."""
    from autopar.planner import dimensions

    n, graph, d = plan.device_num, plan.graph, plan.dp_totals
    # (strategies, sequence or expert marks the user gave are kept: theirs, not a variant)
    if d is None or plan.pipeline is not None or n < 2 or has_strategies(network):
        return
    ctx = _context.auto_parallel_context()
    in_experts = {id(p) for module, *_ in graph.experts for p in module.parameters()}
    sizes = {id(p): float(p.numel() * p.element_size()) for p in network.parameters() if p.requires_grad}
    grads = [b for k, b in sizes.items() if k not in in_experts]
    machine, dispatch = plan.problem.machine, dispatch_of(plan.problem)
    # the attention a sequence split meets: the user's context_parallel_algo where they gave one, else each that can
    # run here (the ring only where its blocks run on the blockwise kernel: elsewhere it runs as the all-gather)
    algos = [ctx.context_parallel_algo] if _context.given_by_user("context_parallel_algo") else \
        ["all_gather", "ulysses"] + (["ring"] if any(blockwise for *_, blockwise in graph.attention) else [])
    split = ctx.dataset_strategy == "data_parallel" and not _attention_dropout(network)
    for algo in algos if split else ():
        for cp in dimensions.context_degrees(graph, n, algo):
            label = f"context parallel {cp}" + (f" x data parallel {n // cp}" if n // cp > 1 else "") + (
                f" ({algo})" if len(algos) > 1 else "")
            plan.variants[label] = Variant(cp, False, Totals(*dimensions.context_totals(
                graph, machine, d, n, cp, list(sizes.values()), dispatch, algo)), algo)
    if dimensions.expert_parallel_ok(graph, n):
        experts = [b for k, b in sizes.items() if k in in_experts]
        plan.variants[f"data parallel + expert parallel {n}"] = Variant(
            1, True, Totals(*dimensions.expert_totals(graph, machine, d, n, grads, experts, dispatch,
                                                      dimensions.experts_timed(graph, machine, n))))
    fitting = {k: v for k, v in plan.variants.items() if memory_limit is None or v[2].memory <= memory_limit}
    if not fitting:
        return
    label = min(fitting, key=lambda k: fitting[k][2].step)
    cp, ep, totals, algo = fitting[label]
    chosen_fits = memory_limit is None or plan.totals.memory <= memory_limit
    if totals.step < plan.totals.step or not chosen_fits:
        why = "does not fit" if not chosen_fits else f"takes {plan.totals.step * 1e3:.1f} ms"
        plan.reason = f"{label} ({totals.step * 1e3:.1f} ms per step); without it: {plan.reason}, which {why}"
        plan.choice, plan.totals, plan.pure_data_parallel, plan.zero_level = plan.problem.dp_choice(), totals, True, None
        plan.context_parallel, plan.expert_parallel, plan.context_parallel_algo = cp, ep, algo


def _attention_dropout(network: torch.nn.Module) -> bool:
    """Does an attention module train with dropout on its weights (``attention_dropout`` / ``attn_dropout`` /
    nanoGPT's ``dropout`` beside its projections)? A sequence split refuses it (its draws cannot be one
    process's); the trace, in eval mode, does not see it."""
    for m in network.modules():
        for attr in ("attention_dropout", "attn_dropout", "dropout_p", "dropout"):
            value = getattr(m, attr, None)
            if isinstance(value, float) and value > 0 and "att" in (type(m).__name__ + attr).lower():
                return True
    return False


def _as_totals(option: PipelineOption) -> Totals:
    return Totals(option.compute, option.comm, option.memory)
