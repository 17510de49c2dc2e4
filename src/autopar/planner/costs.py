"""The cost of every candidate strategy of every node, and of resharding between layouts.

For a node under a strategy (all seconds per training step, on one device):

- **compute**: forward + backward FLOPs (3x the forward) of this device's share / the calibrated rate;
- **gradient all-reduce**: a parameter whose gradient is a partial sum over devices (those splitting labels it
  does not have -- the batch, in data parallel) is all-reduced over them;
- **activation-gradient all-reduce**: likewise for an input activation (e.g. the input of a column-split Linear);
- **resharding**: between this node's layouts and those of its producers / consumers (edges), or the batch-split
  layout of the data-parallel operators around it -- forward collective plus its backward dual
  (all-gather <-> reduce-scatter, Replicate -> Shard costs an all-gather in backward, all-to-all both ways);
- **memory**: the parameter slice times (1 + gradient + optimizer slots) plus the activations kept for backward.

Compute is measured where the machine model carries an operator timer (inside a job: the operator at this rank's
slice shapes, timed on this device, :mod:`autopar.planner.op_timer`); otherwise a roofline: the slower of the
arithmetic (FLOPs / calibrated rate) and streaming the operands through memory (a small-batch layer is bound by
reading its weights). Plus the optimizer step at its calibrated rate (the per-parameter loop on DTensors for layouts,
the fused kernel for pure data parallel) and, for layouts under ``gradients_mean``, the pass that scales the gradients.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import context as _context
from autopar.errors import StrategyError
from autopar.layout.axes import axes_of_device_matrix, mesh_shape_for
from autopar.layout.layout import Layout
from autopar.layout.placements import output_placements
from autopar.layout.strategy import OpPlan, data_parallel_strategy, derive_plan
from autopar.planner.graph import DP, REP, Graph, OpNode
from autopar.planner.machine import MachineModel

OPTIMIZER_SLOTS = 1  # momentum; Adam would be 2


@dataclass(frozen=True)
class Choice:
    strategy: tuple
    plan: OpPlan
    in_placements: tuple  # per tensor input
    out_placements: tuple
    compute: float
    backward: float
    grad_comm: float
    act_comm: float
    memory: float
    is_dp: bool
    label: str
    optimizer: float = 0.0  # of ``compute``: the optimizer step (and gradients_mean's scale pass), once per step
    param_bytes: float = 0.0  # this device's slice of the node's parameters
    activation_bytes: float = 0.0  # activations this device keeps for the backward pass
    out_bytes: float = 0.0  # this device's share of the output (the element-wise work after it runs on as much)
    grad_placements: tuple = ()  # per tensor input: its gradient's placements (partial over the absent axes)


def _splittable(node: OpNode) -> list[str]:
    labels = []
    for labels_of_input in node.spec.inputs:
        for c in labels_of_input:
            if c not in labels and c not in node.spec.unsplittable and c != "1":
                labels.append(c)
    if node.kind == "conv":
        return [c for c in labels if c in "no"]  # batch and output channels
    if node.kind == "linear":
        batch = node.spec.inputs[0][:-1]
        return [c for c in labels if c in "jk" or (batch and c == batch[0])]
    return labels


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _describe(node: OpNode, splits: dict[str, int], device_num: int) -> str:
    if not any(v > 1 for v in splits.values()):
        return "replicated"
    names = {"n": "batch", "o": "out-ch", "c": "in-ch", "j": "out", "k": "contract", "i": "rows"}
    if node.kind == "matmul" and len(node.spec.inputs[0]) == 4:  # attention: (batch, heads, rows, contract)
        names.update(o="heads", j="cols")
    elif node.kind == "softmax":
        dims = ("batch", "heads", "rows", "cols") if len(node.spec.inputs[0]) == 4 else ()
        names = {c: (dims[i] if i < len(dims) else f"dim {i}") for i, c in enumerate(node.spec.inputs[0])}
    batch = node.spec.inputs[0][0] if node.spec.inputs and node.spec.inputs[0] else None
    parts = []
    for c, v in splits.items():
        if v > 1:
            parts.append(f"{'batch' if c == batch else names.get(c, c)} {v}")
    return " x ".join(parts)


def _local_fraction(placements, mesh: tuple[int, ...]) -> float:
    f = 1.0
    for p, n in zip(placements, mesh):
        if isinstance(p, Shard):
            f /= n
    return f


def reshard_cost(machine: MachineModel, src, dst, nbytes: float, mesh: tuple[int, ...],
                 shape: tuple | None = None, itemsize: int = 4, grad=None, backward: bool = True) -> float:
    """Forward + backward seconds to go from placements ``src`` to ``dst`` for a tensor of ``nbytes`` in total: in a
    job, DTensor's redistribution of a tensor of ``shape`` measured on its devices (:meth:`OpTimer.reshard`), its
    backward starting from ``grad`` -- the placements of the consumer's gradient, a partial sum over the mesh axes
    where the consumer's other operand is split (a column-split Linear's input); otherwise (or where it cannot be
    measured) the collectives' alpha-beta model, one mesh axis at a time, and the partial gradient all-reduced.
    ``backward=False``: the forward alone, for a tensor no gradient flows back into (the batch a network is fed:
    the 2-rank MLP's Megatron plan was priced 10.2 ms for gathering its input, 1.4 of them in the step)."""
    grad = tuple(dst) if grad is None or not backward else tuple(grad)
    if tuple(src) == tuple(dst) and grad == tuple(dst):
        return 0.0
    timer = getattr(machine, "op_timer", None)
    if timer is not None and shape is not None:
        measured = timer.reshard(tuple(src), tuple(dst), tuple(shape), itemsize, grad, backward)
        if measured is not None:
            return measured
        if grad != tuple(dst):  # the consumer's partial gradient, summed as the operator's own costs do without one
            local = nbytes * _local_fraction(dst, mesh)
            group = math.prod(n for g, d, n in zip(grad, dst, mesh) if g != d)
            return machine.collective("all_reduce", local, group) + reshard_cost(machine, src, dst, nbytes, mesh)
    if tuple(src) == tuple(dst):
        return 0.0
    local = nbytes * _local_fraction(src, mesh)
    forward = back = 0.0
    for p, q, n in zip(src, dst, mesh):
        if p == q:
            continue
        if isinstance(p, Partial):
            if isinstance(q, Shard):
                forward += machine.collective("reduce_scatter", local, n)
                back += machine.collective("all_gather", local, n)
            else:
                forward += machine.collective("all_reduce", local, n)
        elif isinstance(p, Shard) and isinstance(q, Replicate):
            forward += machine.collective("all_gather", local * n, n)
            back += machine.collective("reduce_scatter", local * n, n)
            local *= n
        elif isinstance(p, Replicate) and isinstance(q, Shard):
            back += machine.collective("all_gather", local, n)  # free forward (a local slice), gathered in backward
            local /= n
        elif isinstance(p, Shard) and isinstance(q, Shard):
            forward += machine.collective("all_to_all", local, n)
            back += machine.collective("all_to_all", local, n)
    return forward + back if backward else forward


def _grad_placements(plan: OpPlan, i: int, placements: tuple, mesh: tuple[int, ...]) -> tuple:
    """The placements of input ``i``'s gradient: its own, with a partial sum over the mesh axes of the split labels
    it does not have (as :func:`autopar.layout.placements.placements_for` gives the runtime)."""
    out = list(placements)
    groups = axes_of_device_matrix(plan.device_matrix, mesh)
    for axis in plan.absent_axes(i):
        for m in groups[axis]:
            out[m] = Partial()
    return tuple(out)


def through_view(placements, dims: tuple | None) -> tuple:
    """A consumer's placements in its producer's dimensions (``dims``: the edge's dimension map); a split of a
    dimension the producer's splits do not carry over becomes a shard no producer layout has (costs a reshard)."""
    if dims is None:
        return tuple(placements)
    out = []
    for p in placements:
        if isinstance(p, Shard):
            d = dims[p.dim] if p.dim < len(dims) else None
            out.append(Shard(d) if d is not None else Shard(1000 + p.dim))
        else:
            out.append(p)
    return tuple(out)


def dp_placements(shape: tuple[int, ...], device_num: int, mesh: tuple[int, ...]):
    if shape and shape[0] % device_num == 0 and device_num > 1:
        return tuple(Shard(0) for _ in mesh)
    return tuple(Replicate() for _ in mesh)


def rep_placements(mesh):
    return tuple(Replicate() for _ in mesh)


def forward_backward_passes(node: OpNode) -> float:
    """An operator's forward + backward, in forward passes: 3 (the backward's two matmuls); a fused attention's
    3.5 (its backward recomputes the scores: FlashAttention-2, arXiv 2307.08691 sec. 4.1: 5 matmuls against 2)."""
    return 3.5 if node.kind == "attention" else 3.0


def nbytes(shape, itemsize: int) -> float:
    return float(math.prod(shape) if shape else 1) * itemsize


def gemm_dims(node: OpNode, plan: OpPlan) -> tuple[int, int, int, int] | None:
    """(batch, M, N, K) of this device's forward GEMM of a Linear or a (batched) matmul, from its labels: K the
    contracted ones, the batch those of both operands and the output, M the first operand's other output labels,
    N the second's; None for anything else."""
    if node.kind not in ("linear", "matmul") or len(node.spec.inputs) < 2:
        return None
    a, w = node.spec.inputs[0], node.spec.inputs[1]
    sizes: dict[str, int] = {}
    for i, labels in enumerate((a, w)):
        shape = plan.inputs[i].slice_shape
        if len(shape) != len(labels):
            return None
        sizes.update(zip(labels, shape))
    out = set(node.spec.output)
    prod = lambda labels: math.prod(sizes[c] for c in labels)  # noqa: E731
    dims = (prod([c for c in a if c in w and c in out]), prod([c for c in a if c in out and c not in w]),
            prod([c for c in w if c in out and c not in a]), prod([c for c in a if c in w and c not in out]))
    return dims if all(dims) else None


class NodeCosts:
    """Candidate choices of one node with their intrinsic costs (reshardings are added by the search)."""

    def __init__(self, node: OpNode, machine: MachineModel, device_num: int):
        self.node = node
        self.mesh = mesh_shape_for(device_num)
        self.device_num = device_num
        dp = data_parallel_strategy(node.spec, list(node.shapes), device_num)
        labels = _splittable(node)
        seen, choices = set(), []
        candidates = [node.fixed] if node.fixed is not None else None
        if candidates is None:
            candidates = []
            for combo in itertools.product(_divisors(device_num), repeat=len(labels)):
                if device_num % math.prod(combo):
                    continue
                splits = dict(zip(labels, combo))
                candidates.append(tuple(tuple(splits.get(c, 1) for c in lab) for lab in node.spec.inputs))
            candidates.append(dp)
        for strategy in candidates:
            strategy = tuple(tuple(s) for s in strategy)
            if strategy in seen:
                continue
            seen.add(strategy)
            if node.fixed is None and any(math.prod(strategy[i]) > 1 for i in node.replicated_params):
                continue  # a parameter tied to a module kept whole (or used by another node): whole here too
            try:
                plan = derive_plan(node.name, node.spec, strategy, node.shapes, device_num)
            except StrategyError:
                continue
            choices.append(self._cost(plan, strategy, machine, strategy == dp))
        if not choices:
            raise StrategyError(f"{node.name}: no valid strategy on {device_num} devices")
        self.choices = choices
        # forward + backward of this operator under data parallel, even where the user fixed another strategy:
        # the data-parallel step measured whole, less these, is what every plan computes outside its operators
        self.dp_compute = self.dp_out_bytes = None
        c = next((c for c in choices if c.is_dp), None)
        if c is None:
            try:
                c = self._cost(derive_plan(node.name, node.spec, dp, node.shapes, device_num), dp, machine, True)
            except StrategyError:
                pass
        if c is not None:
            self.dp_compute, self.dp_out_bytes = c.compute - c.optimizer, c.out_bytes

    def _cost(self, plan: OpPlan, strategy: tuple, machine: MachineModel, is_dp: bool) -> Choice:
        node, mesh = self.node, self.mesh
        splits = {label: plan.device_matrix[axis] for label, axis in plan.label_axis}
        parts = math.prod(splits.values()) if splits else 1
        kind = {"conv": "conv", "softmax": "other", "elementwise": "other", "attention": "attention"}.get(node.kind,
                                                                                                         "matmul")
        grad_comm = act_comm = 0.0
        memory = moved = activations = 0.0
        for i, (_, pname) in enumerate(zip(node.shapes, node.param_names)):
            layout: Layout = plan.inputs[i]
            local = nbytes(layout.slice_shape, node.itemsize)
            moved += local
            group = math.prod(plan.device_matrix[a] for a in plan.absent_axes(i)) if plan.absent_axes(i) else 1
            if pname is not None:
                grad_comm += machine.collective("all_reduce", local, group)
                memory += local * (2 + OPTIMIZER_SLOTS)
            else:
                act_comm += machine.collective("all_reduce", local, group)
                memory += local
                if not isinstance(node.in_sources.get(i), int):  # another node's output is counted there
                    activations += local
        out_split = math.prod(plan.device_matrix[a] for a in plan.output_map if a >= 0) if plan.output_map else 1
        memory += nbytes(node.out_shape, node.itemsize) / out_split
        activations += nbytes(node.out_shape, node.itemsize) / out_split
        if node.kind == "attention":  # the fused kernel keeps one fp32 log-sum-exp per row for its backward
            lse = nbytes(node.out_shape[:-1], 4) / out_split
            memory += lse
            activations += lse
        moved += nbytes(node.out_shape, node.itemsize) / out_split
        timer = getattr(machine, "op_timer", None)
        measured = timer.node(node, [plan.inputs[i].slice_shape for i in range(len(node.shapes))]) if timer else None
        if measured is not None:  # this operator at this rank's shapes, timed on this job's device
            compute, backward = measured[1], measured[1] - measured[0]
        elif getattr(machine, "gemm_seconds", None) and (dims := gemm_dims(node, plan)):
            # a cluster device: the forward GEMM and the backward's two (input and weight gradients), each at the
            # rate its own output shape reaches on the device's SMs
            b, m, n, k = dims
            linear = node.kind == "linear"
            forward, backward = machine.gemm_seconds(b, m, n, k, linear), machine.gemm_seconds(b, m, k, n, linear) + \
                machine.gemm_seconds(b, n, k, m, linear)
            compute = max(forward + backward, 3.0 * moved / machine.memory_bandwidth)
            backward = compute * backward / (forward + backward)
        else:
            passes = forward_backward_passes(node)
            compute = machine.compute(kind, passes * node.flops / parts, 3.0 * moved)
            backward = compute * (passes - 1.0) / passes
        # the optimizer step over this device's slice, at the calibrated rate of the layout modes (DTensor
        # parameters: no fused kernel); pure data parallel's fused rate replaces it in its totals (plan.py)
        params = sum(nbytes(plan.inputs[i].slice_shape, node.itemsize) for i, n in enumerate(node.param_names) if n)
        optimizer = params / machine.optimizer_rate("layout")
        if gradients_scaled(self.device_num):  # gradients_mean's pass over the slices' gradients (layouts only:
            optimizer += params / machine.optimizer_rate("scale")  # data parallel scales on its copy into a bucket)
        compute += optimizer
        in_pl = tuple(plan.inputs[i].placements(mesh) for i in range(len(node.shapes)))
        out_pl = output_placements(plan.device_matrix, plan.output_map, plan.partial_axes, "sum"
                                   if plan.reduction == "avg" else plan.reduction, mesh)
        grad_pl = tuple(_grad_placements(plan, i, in_pl[i], mesh) for i in range(len(node.shapes)))
        if timer is not None:  # in a job the redistributions into this operator are measured with their backward,
            act_comm = 0.0     # which sums this partial gradient as the runtime does (reshard_cost)
        return Choice(strategy, plan, in_pl, out_pl, compute, backward, grad_comm, act_comm, memory, is_dp,
                      "data parallel" if is_dp else _describe(node, splits, self.device_num), optimizer, params,
                      activations, nbytes(node.out_shape, node.itemsize) / out_split, grad_pl)

    def comm(self, c: Choice, machine: MachineModel) -> float:
        """Everything ``c`` communicates on its own: gradient and activation all-reduces, boundary reshardings."""
        return c.grad_comm + c.act_comm + self.boundary_cost(c, machine)

    def boundary_cost(self, c: Choice, machine: MachineModel) -> float:
        """Resharding from the batch-split / replicated inputs and to the data-parallel consumers."""
        node, cost = self.node, 0.0
        for i, src in node.in_sources.items():
            backward = i not in node.no_grad_inputs
            if src == DP:
                cost += reshard_cost(machine, dp_placements(node.shapes[i], self.device_num, self.mesh),
                                     c.in_placements[i], nbytes(node.shapes[i], node.itemsize), self.mesh,
                                     node.shapes[i], node.itemsize, c.grad_placements[i], backward)
            elif src == REP:
                cost += reshard_cost(machine, rep_placements(self.mesh), c.in_placements[i],
                                     nbytes(node.shapes[i], node.itemsize), self.mesh, node.shapes[i], node.itemsize,
                                     c.grad_placements[i], backward)
        if node.out_to_dp:
            cost += node.out_to_dp * reshard_cost(machine, c.out_placements,
                                                  dp_placements(node.out_shape, self.device_num, self.mesh),
                                                  nbytes(node.out_shape, node.itemsize), self.mesh, node.out_shape,
                                                  node.itemsize)
        return cost


def shared_reduction(a: NodeCosts, ca: Choice, i: int, b: NodeCosts, cb: Choice, j: int,
                     machine: MachineModel) -> float:
    """Seconds to take off when node ``b``'s input ``j`` is the very tensor node ``a``'s input ``i`` is, from
    outside the operators (one norm's output into q, k and v, or into gate and up: ``OpNode.same_input``), and both
    choices take it alike: autograd sums their partial gradients first, and the redistribution's backward reduces
    the sum once -- each boundary cost priced its own reduction.

    Why: Megatron's Llama block on 4 ranks reduces its two inputs' gradients twice a step (counted with
    ``CommDebugMode``); the planner priced five reductions, 0.1 s a step over its 0.72. (Pairs with the first
    consumer only: where k and v split alike but unlike q, their one shared reduction is still priced twice.)"""
    src = b.node.in_sources.get(j)
    if src not in (DP, REP) or i not in a.node.in_sources or j in b.node.no_grad_inputs:
        return 0.0
    if (ca.in_placements[i], ca.grad_placements[i]) != (cb.in_placements[j], cb.grad_placements[j]):
        return 0.0
    node = b.node
    start = dp_placements(node.shapes[j], b.device_num, b.mesh) if src == DP else rep_placements(b.mesh)
    args = (machine, start, cb.in_placements[j], nbytes(node.shapes[j], node.itemsize), b.mesh, node.shapes[j],
            node.itemsize, cb.grad_placements[j])
    back = reshard_cost(*args, True) - reshard_cost(*args, False)
    if getattr(machine, "op_timer", None) is None:  # (the alpha-beta model prices it in the node's act_comm)
        plan, absent = cb.plan, cb.plan.absent_axes(j)
        group = math.prod(plan.device_matrix[a] for a in absent) if absent else 1
        back += machine.collective("all_reduce", nbytes(plan.inputs[j].slice_shape, node.itemsize), group)
    return max(0.0, back)


def gradients_scaled(device_num: int) -> bool:
    """Does a layout's step multiply every gradient by ``gradients_mean``'s factor (1/n) after its backward? As
    :meth:`autopar.parallel.grads.layouts.LayoutGrads.scale` decides, but for the loss and outputs the planner cannot
    see: with ``full_batch`` every rank holds the whole batch and the factor is 1."""
    ctx = _context.auto_parallel_context()
    return device_num > 1 and bool(ctx.gradients_mean) and not ctx.full_batch


def graph_costs(graph: Graph, machine: MachineModel, device_num: int) -> list[NodeCosts]:
    return [NodeCosts(node, machine, device_num) for node in graph.nodes]


def charge_attention(graph: Graph, costs: list[NodeCosts], machine: MachineModel, device_num: int) -> float:
    """Charge every SDPA call's forward + backward to the node its query comes from, each choice in proportion to
    its share of that node's output: attention runs on the heads (and batch) the query's producer leaves this rank
    -- a quarter of them after a column-split ``q`` on 4 ranks, all of them after a row-split one's all-reduce.
    Timed at data parallel's shapes in a job (:meth:`autopar.planner.op_timer.OpTimer.attention`), else the
    roofline of its FLOPs (FlashAttention's backward recomputes the scores: 2.5x the forward). Returns the seconds
    charged under data parallel (a call whose query comes from no node is charged nothing).

    Why: SDPA is no node, so its time was part of the work between the operators, spread over them by their
    outputs' shares -- as if it ran as split as the whole block's outputs. Megatron's pairs leave the row-split
    ``o`` and ``down`` whole outputs; so attention was charged at ~40 % of its data-parallel time on each of 4
    ranks where each computes a quarter of the heads, and ``bench/auto_vs_hand.py``'s 4,096-token Llama block
    under Megatron's layout was predicted 32 % slow -- AUTO never tried it, and ran 1.21x its time."""
    timer = getattr(machine, "op_timer", None)
    charged = 0.0
    for (q, k, v, item, causal, _), source in zip(graph.attention, graph.attention_sources):
        if source is None or costs[source].dp_out_bytes is None or not costs[source].dp_out_bytes:
            continue
        splits = graph.batch % device_num == 0  # (data parallel splits the batch, or -- full_batch -- nothing)
        share = [(s[0] // device_num,) + tuple(s[1:]) if splits and s and s[0] % device_num == 0 else s
                 for s in (q, k, v)]
        measured = timer.attention(share, item, causal) if timer is not None else None
        if measured is not None:
            seconds = measured[1]
        else:
            flops = 2.0 * math.prod(share[0]) * k[-2] * (1 if causal else 2)  # q k^T and p v, causal: half
            seconds = machine.compute("attention", 3.5 * flops)
        _charge(costs[source], seconds)
        charged += seconds
    return charged


def spread_between(costs: list[NodeCosts], seconds: float) -> bool:
    """Charge ``seconds`` -- the compute between the operators under data parallel (normalisations, activations,
    residual adds, reshapes, the loss) -- to the operators whose outputs that work consumes: each choice in
    proportion to its share of the output. Under data parallel every rank runs 1/n of it; a row-split Linear's
    output is whole on every rank after its all-reduce, and the LayerNorm and residual add after it run on all of
    it (Megatron's blocks on 2 ranks measured 12-20 % slower than a constant 1/n predicted). False (nothing
    charged) where the data-parallel outputs are unknown."""
    total = sum(nc.dp_out_bytes or 0.0 for nc in costs)
    if seconds <= 0 or total <= 0 or any(nc.dp_out_bytes is None for nc in costs):
        return False
    for nc in costs:
        _charge(nc, seconds * nc.dp_out_bytes / total)
    return True


def _charge(nc: NodeCosts, seconds: float) -> None:
    """Add work data parallel spends ``seconds`` on after ``nc`` to each of its choices, in proportion to the
    choice's share of the node's output against data parallel's (a row-split Linear's whole output: n times)."""
    if seconds and nc.dp_out_bytes:
        nc.choices = [dataclasses.replace(c, compute=c.compute + seconds * c.out_bytes / nc.dp_out_bytes)
                      for c in nc.choices]
        nc.dp_compute += seconds
