"""One decoder layer (and the output head) planned on a tensor group by the operator-level search.

A layer is captured once per micro-batch (and share of the sequence) on the meta device, and its operators' strategies
chosen by the exact ILP of :mod:`autopar.planner.search` on the tensor group's own links; every layer of the model is
the same (Alpa clusters them the same way). Under sequence parallelism the projections take Megatron's layout.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from autopar.errors import StrategyError
from autopar.planner.cluster.attention import attention_core, kept_by_core, with_context_parallel
from autopar.planner.cluster.collectives import behind
from autopar.planner.cluster.experts import expert_block
from autopar.planner.cluster.kernels import (
    FUSED_LOSS_TRAFFIC_BYTES_PER_LOGIT,
    LOSS_TRAFFIC_BYTES_PER_LOGIT,
    fp8_cast_seconds,
)
from autopar.planner.cluster.memory import kept_twice, loss_peak_bytes, whole_on_every_device
from autopar.planner.cluster.spec import ClusterSpec
from autopar.planner.cluster.tensor import is_megatron, layer_seconds, megatron_strategy
from autopar.planner.costs import NodeCosts, forward_backward_passes, graph_costs
from autopar.planner.gpt import GPTConfig, GPTHead, TokenLoss, make_layer
from autopar.planner.graph import Graph, capture
from autopar.planner.plan import other_param_bytes
from autopar.planner.search import Problem, solve_ilp

# fp8: Transformer Engine's recipe -- the projections' GEMMs (forward and both gradients) in fp8, everything else
# (attention, norms, the activations and weights kept, the collectives) in bf16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.bfloat16}


@dataclass
class LayerPlan:
    """One module (a decoder layer, or the head with the loss) planned on a tensor group of ``t`` for one
    micro-batch of ``b``."""
    t: int
    b: int
    graph: Graph
    costs: list[NodeCosts]
    problem: Problem
    choice: list[int]
    time: float  # forward + backward seconds: compute, tensor-group communication, resharding (no optimizer step)
    forward: float
    param_count: float  # this device's parameters (the planned operators' slices + the small replicated ones)
    activation_bytes: float
    input_bytes: float  # the layer input a recomputing layer keeps
    # what selective recomputation (Korthikanti et al. 2022, arXiv 2205.05198 sec. 5) drops and recomputes: the
    # materialized attention's s x s scores and softmax, or the fused kernel's log-sum-exp (attention.kept_by_core)
    core_activation_bytes: float = 0.0
    core_forward: float = 0.0  # seconds of its forward (the scores matmul, the softmax, the context matmul)
    context_ring: float = 0.0  # seconds of context parallelism's key/value ring not hidden behind the attention
    # Megatron's layout: the exposed tensor-parallel collectives by the projection they belong to (tensor.py), in
    # place of the operator-level search's own pricing of them
    tp_comm: dict | None = None
    extra_rows: tuple = ()  # rows of work outside the captured operators (the head's cross entropy), as rows() gives
    # a mixture of experts (experts.py): this device's experts' parameters (sharded and synchronised over the
    # expert-data-parallel ranks, not the attention's), and the seconds of its all-to-alls left exposed
    expert_param_count: float = 0.0
    dispatch: float = 0.0

    def rows(self) -> list[tuple]:
        out = []
        for n, node in enumerate(self.graph.nodes):
            c = self.costs[n].choices[self.choice[n]]
            comm = self.tp_comm.get(node.name, 0.0) if self.tp_comm is not None else \
                self.costs[n].comm(c, self.problem.machine)
            out.append((node.name, node.kind, node.shapes_text(), str(c.strategy), c.label,
                        (c.compute - c.optimizer) * 1e3, comm * 1e3))
        return out + list(self.extra_rows)


def plan_module(module: torch.nn.Module, loss: torch.nn.Module | None, inputs: tuple, t: int, spec: ClusterSpec,
                dtype: str, graph: Graph | None = None, sp: bool = False, attention: str = "fused",
                tp_overlap: str = "megatron", fp8_recipe: str | None = None) -> LayerPlan:
    """``graph``: the module's capture at these inputs, if made already (it does not depend on ``t``).

    ``sp``: Megatron's sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198 sec. 4.2.2) -- the norms,
    dropout and residuals run on ``1/t`` of the sequence, and the inputs the tensor group otherwise keeps whole (a
    column-split projection's) are kept split on the sequence and gathered again in the backward, overlapped with
    the input-gradient matmul as Megatron-LM does. In Megatron's layout the tensor group's collectives are those
    Megatron-Core runs and hides (``tensor.py``), or as ``tp_overlap`` says another stack hides them.

    ``fp8_recipe`` (under fp8): how the projections' operands are scaled and cast to fp8 (``kernels.FP8_CAST_BYTES``),
    memory-bound work before the fp8 GEMMs."""
    graph = graph or capture(module, loss, inputs)
    if t > 1:  # the tensor group runs Megatron's layout, as every stack the planner predicts does
        graph = _megatron_layout(graph, t)
    machine = spec.group_machine(t, 1, dtype, attention)
    costs = graph_costs(graph, machine, t)
    problem = Problem(graph, costs, machine, 0.0, None)
    choice = solve_ilp(problem)
    if choice is None:
        raise StrategyError(f"no strategy for {type(module).__name__} on a tensor group of {t}")
    chosen = [costs[n].choices[s] for n, s in enumerate(choice)]
    optimizer = sum(c.optimizer for c in chosen)
    b = int(inputs[0].shape[0])
    # Megatron's layout (tensor.py): its collectives as Megatron-Core runs and hides them, the norms and residuals
    # whole on every rank of the group without sequence parallelism, split on the sequence with it
    megatron = t > 1 and is_megatron(graph, chosen, t)
    tp_comm, tp_forward = layer_seconds(graph, chosen, machine, t, sp, tp_overlap) if megatron else (None, 0.0)
    if megatron:
        total = sum(c.compute for c in chosen) - optimizer + sum(tp_comm.values())
    else:
        total = problem.total(choice) - optimizer
    # data-parallel operators (norms, the loss) split the batch when they can, the sequence under sequence parallelism
    split = t if sp or (b % t == 0 and not megatron) else 1
    # norms and the loss (batch split when possible), and the element-wise work between the planned operators
    # (biases, GELU, the causal mask and scaling of the scores: split with the tensors they follow, taken as split
    # over the group): memory-bound, forward + backward ~ 3x the traffic
    other = machine.compute("other", 3.0 * graph.other_flops / split, 3.0 * (
        2 * graph.other_activation_bytes / split + graph.elementwise_bytes / t))
    casts, casts_forward = fp8_cast_seconds(graph.nodes, chosen, spec.memory_bandwidth, t, sp, fp8_recipe) \
        if dtype == "fp8" and fp8_recipe else (0.0, 0.0)
    itemsize = inputs[0].element_size()
    params = (sum(c.param_bytes for c in chosen) + other_param_bytes(module, graph)) / itemsize
    activations = sum(c.activation_bytes for c in chosen) + graph.other_activation_bytes / split \
        - kept_twice(graph, chosen)
    if sp:
        activations -= (1 - 1 / t) * whole_on_every_device(graph, chosen)
    core = [(node, c) for node, c in zip(graph.nodes, chosen) if attention_core(node)]
    # the forward (what a recomputation runs again): a third of each operator's compute (a fused attention's 1 of
    # its 3.5 passes) and, in Megatron's layout, its collectives
    forward = sum((c.compute - c.optimizer) / forward_backward_passes(node) for node, c in zip(graph.nodes, chosen)) + other / 3.0
    return LayerPlan(t, b, graph, costs, problem, choice, total + other + casts, forward + tp_forward + casts_forward,
                     params, activations,
                     inputs[0].numel() * itemsize / split,
                     sum(kept_by_core(node, c) for node, c in core),
                     sum((c.compute - c.optimizer) / forward_backward_passes(node) for node, c in core), tp_comm=tp_comm)


def _megatron_layout(graph: Graph, t: int) -> Graph:
    """``graph`` with its projections pinned to Megatron's column / row splits over ``t`` (the attention between
    them follows by heads): sequence parallelism's all-gather before a column-split projection and reduce-scatter
    after a row-split one are defined on that layout, not on whatever else the search might find as fast."""
    nodes = []
    for node in graph.nodes:
        fixed = megatron_strategy(node, t)
        nodes.append(dataclasses.replace(node, fixed=fixed) if fixed is not None else node)
    return dataclasses.replace(graph, nodes=nodes)


# what a layer plan holds per layer, averaged where a model's layers differ
_PER_LAYER = ("time", "forward", "param_count", "activation_bytes", "input_bytes", "core_activation_bytes",
              "core_forward", "context_ring", "expert_param_count", "dispatch")


def average_layer(layer: LayerPlan, other: LayerPlan, share: float) -> LayerPlan:
    """``layer`` standing for a model whose ``share`` of layers are ``other`` (a mixture's dense first layers, the
    sliding-window layers): its
    time, memory and parameters the layers' average -- the search plans every layer alike, so stages are costed at
    the average layer; the operator rows stay ``layer``'s."""
    return dataclasses.replace(layer, **{k: (1 - share) * getattr(layer, k) + share * getattr(other, k)
                                         for k in _PER_LAYER})


class LayerPlanner:
    """The plans of one decoder layer and of the output head, per (tensor degree, micro-batch, context degree,
    sequence parallelism) -- each made once and reused by every candidate that needs it."""

    def __init__(self, config: GPTConfig, spec: ClusterSpec, dtype: str, fused_loss: bool = False,
                 dispatcher: str = "alltoall", ep_overlap: bool = False, tp_overlap: str = "megatron",
                 fp8_recipe: str = "delayed"):
        """``fused_loss``: the cross entropy one fused kernel that writes its gradient over the logits (no fp32
        copies kept: ``memory.loss_peak_bytes``), as a run that only fits with one ran it. ``dispatcher`` and
        ``ep_overlap``: how a mixture of experts' tokens travel (``experts.py``), and whether its all-to-alls hide
        behind another micro-batch's compute (Megatron-Core's ``--overlap-moe-expert-parallel-comm``: the forward of
        one micro-batch beside the backward of another, each one's all-to-alls under the other's GEMMs).
        ``tp_overlap``: which tensor-parallel collectives hide behind GEMMs (``tensor.py``: megatron or none).
        ``fp8_recipe``: under fp8, how the projections' operands are scaled (``kernels.FP8_CAST_BYTES``); None in
        another dtype."""
        self.config, self.spec, self.dtype, self.fused_loss = config, spec, dtype, fused_loss
        self.tp_overlap, self.fp8_recipe = tp_overlap, fp8_recipe if dtype == "fp8" else None
        self.dispatcher, self.ep_overlap = dispatcher, ep_overlap
        self.torch_dtype = DTYPES[dtype]
        self.itemsize = torch.tensor([], dtype=self.torch_dtype).element_size()
        self._layers: dict = {}
        self._heads: dict = {}
        c = config
        with torch.device("meta"):
            self.layer_module = make_layer(c).to(self.torch_dtype)
            # a mixture's dense layers (DeepSeek-V3's first three), planned apart and averaged in (``layer``)
            self.dense_module = make_layer(c, dense=True).to(self.torch_dtype) if c.moe and c.dense_layers else None
            # the sliding-window layers (GPT-OSS's every other one), planned apart and averaged in
            self.window_module = make_layer(c, window=True).to(self.torch_dtype) if c.sliding_window else None
        self._head_modules: dict = {}  # padded vocabulary -> the head's module (meta)
        self._graphs: dict = {}  # (layer | head, micro-batch, cp) -> its capture: the same for every tensor degree

    def with_fused_loss(self) -> "LayerPlanner":
        """The same planner with a fused cross entropy: its layers' plans and captures shared (the loss is the
        head's alone), its heads planned again."""
        fused = LayerPlanner(self.config, self.spec, self.dtype, fused_loss=True, dispatcher=self.dispatcher,
                             ep_overlap=self.ep_overlap, tp_overlap=self.tp_overlap, fp8_recipe=self.fp8_recipe)
        fused._layers, fused._graphs, fused._head_modules = self._layers, self._graphs, self._head_modules
        fused.layer_module, fused.dense_module, fused.window_module = (self.layer_module, self.dense_module,
                                                                       self.window_module)
        return fused

    def padded_vocab(self, t: int) -> int:
        """The vocabulary a tensor group of ``t`` splits: padded up to a multiple of ``t`` where it is not one, as
        Megatron-LM pads it (``--make-vocab-size-divisible-by``; nanoGPT's 50304 for GPT-2's 50257)."""
        return -(-self.config.vocab // t) * t

    def head_module(self, t: int) -> torch.nn.Module:
        v = self.padded_vocab(t)
        if v not in self._head_modules:
            with torch.device("meta"):
                self._head_modules[v] = GPTHead(self.config.hidden, v, rms=self.config.llama).to(self.torch_dtype)
        return self._head_modules[v]

    def _graph(self, which: str, b: int, cp: int, module, loss, inputs) -> Graph:
        if (which, b, cp) not in self._graphs:
            self._graphs[(which, b, cp)] = capture(module, loss, inputs)
        return self._graphs[(which, b, cp)]

    def layer(self, t: int, b: int, cp: int = 1, sp: bool = False, ep: int = 1) -> LayerPlan:
        """One decoder layer on a tensor group of ``t`` for a micro-batch of ``b``, with ``1/cp`` of the sequence;
        a mixture of experts' over an expert-parallel group of ``ep``."""
        c = self.config
        plan = self._captured("layer", self.layer_module, t, b, cp, sp)
        if not c.moe and self.window_module is None:
            return plan
        if (t, b, cp, sp, ep) not in self._layers:
            mixture = (lambda p: self._with_experts(p, b, cp, sp, ep)) if c.moe else (lambda p: p)  # noqa: E731
            layer = mixture(plan)
            if self.window_module is not None:
                window = mixture(self._captured("window", self.window_module, t, b, cp, sp))
                layer = average_layer(layer, window, c.windowed_layers / c.layers)
            if self.dense_module is not None:  # dense layers taken as full attention's
                layer = average_layer(layer, self._captured("dense", self.dense_module, t, b, cp, sp),
                                      c.dense_layers / c.layers)
            self._layers[(t, b, cp, sp, ep)] = layer
        return self._layers[(t, b, cp, sp, ep)]

    def _captured(self, which: str, module, t: int, b: int, cp: int, sp: bool) -> LayerPlan:
        """``module`` (a decoder layer) captured at a micro-batch of ``b`` and ``1/cp`` of the sequence and planned
        on a tensor group of ``t``."""
        if (which, t, b, cp, sp) not in self._layers:
            c = self.config
            x = torch.empty(b, c.seq // cp, c.hidden, dtype=self.torch_dtype, device="meta")
            graph = self._graph(which, b, cp, module, None, (x,))
            plan = plan_module(module, None, (x,), t, self.spec, self.dtype, graph, sp, c.attention, self.tp_overlap,
                               self.fp8_recipe)
            self._layers[(which, t, b, cp, sp)] = with_context_parallel(plan, cp, self.spec)
        return self._layers[(which, t, b, cp, sp)]

    def _with_experts(self, plan: LayerPlan, b: int, cp: int, sp: bool, ep: int) -> LayerPlan:
        """The captured attention half of a mixture-of-experts layer (``gpt.LlamaLayer(experts=True)``) with its
        experts (``experts.py``) on the rank's tokens -- its share of the sequence, and of that 1/t under sequence
        parallelism (a tensor group without it holds the same tokens on every rank: Megatron-Core requires sequence
        parallelism beside expert parallelism, and the search runs a mixture's tensor groups with it)."""
        c = self.config
        tokens = b * c.seq / cp / (plan.t if sp else 1)
        block = expert_block(c, self.spec, self.spec.group_machine(1, 1, self.dtype), tokens, ep, self.dispatcher,
                             self.itemsize, self.fp8_recipe)
        dispatch = block.dispatch
        if self.ep_overlap:  # the all-to-alls under the other micro-batch's attention and experts
            dispatch = behind(block.dispatch, block.compute + plan.time, self.spec.overlap_slowdown)
        return dataclasses.replace(
            plan, time=plan.time + block.compute + dispatch, forward=plan.forward + block.forward,
            param_count=plan.param_count + block.router_param_count, expert_param_count=block.param_count,
            activation_bytes=plan.activation_bytes + block.activation_bytes, dispatch=dispatch,
            extra_rows=plan.extra_rows + block.rows)

    def head(self, t: int, b: int, cp: int = 1, sp: bool = False) -> LayerPlan:
        if (t, b, cp, sp) not in self._heads:
            c = self.config
            x = torch.empty(b, c.seq // cp, c.hidden, dtype=self.torch_dtype, device="meta")
            y = torch.empty(b, c.seq // cp, dtype=torch.long, device="meta")
            module = self.head_module(t)
            graph = self._graph(f"head{self.padded_vocab(t)}", b, cp, module, TokenLoss(), (x, y))
            # the output projection stays in bf16 under fp8: Megatron-Core's output layer is not a Transformer Engine
            # module, and torchtitan's float8 converter leaves ``output`` out (its ``filter_fqns``)
            plan = plan_module(module, TokenLoss(), (x, y), t, self.spec, "bf16" if self.dtype == "fp8" else self.dtype,
                               graph, sp, tp_overlap=self.tp_overlap)
            # the logits (the projection's output, as the plan keeps them) give way to the fp32 loss's peak
            logits = sum(plan.costs[n].choices[plan.choice[n]].out_bytes
                         for n, node in enumerate(plan.graph.nodes) if node.name.split(".")[-1] == "out")
            assert logits > 0, "the head's vocabulary projection ('out') was not captured"
            # the cross entropy over this device's logits, memory-bound (kernels.LOSS_TRAFFIC_BYTES_PER_LOGIT)
            traffic = FUSED_LOSS_TRAFFIC_BYTES_PER_LOGIT if self.fused_loss else LOSS_TRAFFIC_BYTES_PER_LOGIT
            per = {k: logits / self.itemsize * v / self.spec.memory_bandwidth for k, v in traffic.items()}
            peak = logits if self.fused_loss else loss_peak_bytes(logits, self.itemsize)
            row = ("cross entropy", "loss", f"{logits / self.itemsize:,.0f} logits",
                   "fused" if self.fused_loss else "fp32", "vocabulary-parallel" if t > 1 else "whole",
                   (per["forward"] + per["backward"]) * 1e3, 0.0)
            self._heads[(t, b, cp, sp)] = dataclasses.replace(
                plan, activation_bytes=plan.activation_bytes - logits + peak,
                time=plan.time + per["forward"] + per["backward"], forward=plan.forward + per["forward"],
                extra_rows=(row,))
        return self._heads[(t, b, cp, sp)]
