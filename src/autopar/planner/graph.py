"""Graph capture: one real forward pass (without gradients) of the network and its loss, recorded as operators.

Only the operators whose strategy the planner chooses become nodes: ``nn.Linear``, ``nn.Conv2d`` and the
``MatMul`` / ``BatchMatMul`` / ``Softmax`` operators (those that hold parameters, dominate compute, or -- the softmax
of attention scores -- hold the largest activation). Everything between them is
classified by how the semi-auto runtime will execute it, which is what decides the communication the plan costs:

- *transparent* (element-wise activations, view-like functions): the layout passes through unchanged;
- *data-parallel* (BatchNorm, pooling, loss modules, the small autopar operators without a strategy): the input is
  redistributed to "batch split over every device" and the output has that layout;
- *join* (an element-wise function of two activations, e.g. a residual add): the second operand is resharded to
  the first one's layout.

Every tensor carries its *source*: the node that laid it out, or "dp" (batch split) / "rep" (whole on every rank).
A node's input from another node is an edge (resharding between their layouts); an input from "dp" or an output
that a data-parallel consumer takes costs a resharding to or from the batch split. Views between two nodes
(reshape, transpose, permute) are followed dimension by dimension, so that ``[b, s, h] -> [b, heads, s, h/heads]``
keeps a split of ``h`` as a split of the heads: each tensor carries, per dimension, the producer's dimension whose
split it continues (the edge's *dimension map*).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from autopar.labels import call_loss

# (importing the runtime also installs its operator executor, which the tracer stacks its own on top of)
from autopar.layout.leaves import LAYOUT_TRANSPARENT, mixes_tokens, stacked_experts, token_wise
from autopar.layout.spec import OpSpec
from autopar.ops import primitive as _primitive
from autopar.ops.comm import _CommPrimitive
from autopar.ops.math import BatchMatMul, FusedAttention, MatMul, ShardablePrimitive, Softmax
from autopar.ops.shard import Conv2dOp, LinearOp, _Sharded

DP, REP = "dp", "rep"


@dataclass
class OpNode:
    index: int
    name: str
    kind: str  # linear | conv | matmul | softmax | attention | elementwise
    target: Any  # the module or operator a strategy is given to
    spec: OpSpec
    shapes: tuple  # every tensor input's shape (activations and parameters)
    activation_inputs: tuple[int, ...]  # which of those are activations
    param_names: tuple[str | None, ...]  # name of each input if it is a parameter
    out_shape: tuple[int, ...]
    flops: float  # forward
    itemsize: int
    fixed: tuple | None = None  # a strategy the user gave: respected
    in_sources: dict[int, Any] = field(default_factory=dict)  # activation input -> DP | REP | node index
    out_to_dp: int = 0  # how many consumers take the output in the batch-split layout
    # activation inputs no gradient flows back into (the batch itself, what is made from it alone): their
    # redistribution runs forward only -- the backward that :func:`autopar.planner.costs.reshard_cost` prices for
    # the others never runs for them
    no_grad_inputs: frozenset = frozenset()
    # activation input -> (an earlier node, its input) fed the very same tensor from outside the planned operators
    # (one norm's output into q and kv, or into gate and up): autograd keeps it once
    same_input: dict[int, tuple[int, int]] = field(default_factory=dict)
    # parameter inputs that must stay whole: tied to a module the runtime keeps replicated (a GPT's token embedding
    # under its output head) or used by another node too -- a split of one user would not be the other's
    replicated_params: frozenset = frozenset()

    def shapes_text(self) -> str:
        """``a b -> out`` (the first two inputs), as the plan tables show it."""
        return " ".join("x".join(map(str, s)) for s in self.shapes[:2]) + " -> " + "x".join(map(str, self.out_shape))


@dataclass
class Graph:
    nodes: list[OpNode]
    edges: list[tuple[int, int, int]]  # (producer node, consumer node, consumer input)
    edge_dims: dict  # (producer, consumer, input) -> per consumer dimension, the producer's dimension (or None)
    joins: list[tuple[int, int]]  # (a, b): b's output is resharded to a's layout
    other_flops: float  # forward FLOPs of everything else (data-parallel: divided over the devices)
    other_activation_bytes: float  # their saved activations (batch split)
    batch: int
    seconds: float = 0.0
    elementwise_bytes: float = 0.0  # memory traffic of the element-wise functions and activations between nodes
    tensor_calls: int = 0  # torch functions of one forward that made a tensor (a layout pays DTensor's dispatch each)
    # edges whose tensor went through a function that is not linear (an activation, a normalisation): a partial sum
    # of the producer is summed (all-reduced to whole) before it, whatever layout the consumer asks for
    edge_resolved: frozenset = frozenset()
    # what context and expert parallelism are weighed on (autopar.planner.dimensions): every SDPA call's (query,
    # key, value) shapes, itemsize, whether it is causal and whether the CPU's blockwise kernel takes it (CPU
    # tensors, as many key as query heads -- or under enable_gqa, key heads that divide them --, no mask: the ring's
    # call too); every module of stacked experts as
    # (module, parameter bytes, hidden-state shape, itemsize, experts, experts each token chooses); whether a module
    # may combine positions along the sequence (a convolution, an RNN, or any leaf module not known to be
    # token-wise: no sequence split then); the inputs'
    # common dimension 1 (None where they have none)
    attention: tuple = ()
    experts: tuple = ()
    mixes_tokens: bool = False
    sequence: int | None = None
    # per SDPA call in ``attention``: the node whose output its query is (through views, RoPE's products, ...), or
    # None -- attention runs as split as that node leaves the query's heads (autopar.planner.costs.charge_attention)
    attention_sources: tuple = ()


def _numel(shape) -> int:
    return int(math.prod(shape)) if shape else 1


def _flops(kind: str, shapes, out_shape, groups: int = 1) -> float:
    if kind == "linear":
        x, w = shapes[0], shapes[1]
        return 2.0 * _numel(x) * w[0]
    if kind == "conv":
        w = shapes[1]
        return 2.0 * _numel(out_shape) * (w[1] * w[2] * w[3])
    if kind == "softmax":
        return 5.0 * _numel(out_shape)  # max, subtract, exp, sum, divide
    if kind == "attention":  # q k^T and p v, 2 b h i j (d + e), of which the causal kernel computes half
        q, k, v = shapes[0], shapes[1], shapes[2]
        return _numel(q) * k[2] * (1.0 + v[-1] / q[-1])
    if kind == "elementwise":
        return float(max(_numel(s) for s in (*shapes, out_shape)))
    a = shapes[0]
    return 2.0 * _numel(out_shape) * a[-1] if kind == "matmul" else 0.0


def _labels_fit(spec, args) -> bool:
    """Whether ``spec`` labels every tensor input dimension by dimension -- not so for an operator whose strategy
    describes its output (MindSpore's OneHot: 1-D indices, a 2-D strategy), which then runs data-parallel."""
    return all(not isinstance(a, torch.Tensor) or not labels or len(labels) == a.dim()
               for a, labels in zip(args, spec.inputs))


_VIEWS = {"reshape", "view", "transpose", "permute", "contiguous", "flatten", "unflatten", "swapaxes"}
# functions through which DTensor carries a partial sum as it is (a sum of parts stays a sum of parts); any other
# function -- an activation, a normalisation, an exponential -- needs the whole value first, so a partial sum is
# all-reduced before it (the row-split Linears of an MLP pay an all-reduce before each ReLU, not the
# reduce-scatter a chain of them would otherwise need)
_LINEAR = _VIEWS | {"add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__rsub__", "__isub__", "sub_",
                    "neg", "__neg__", "clone", "to", "float", "double", "half", "bfloat16", "type_as", "__getitem__",
                    "narrow", "split", "chunk", "unbind", "squeeze", "unsqueeze", "expand", "sum", "mean"}
_SCALED = {"mul", "__mul__", "__rmul__", "__imul__", "mul_", "div", "__truediv__", "__itruediv__", "div_"}


def _view_dims(before: tuple, after: tuple, dims: tuple) -> tuple:
    """Per dimension of a reshaped tensor, the producer dimension whose split it continues (the leading factor of
    a split dimension, the first of merged ones); None where a split would not carry over."""
    out: list = [None] * len(after)
    i = j = 0
    while i < len(before) and j < len(after):
        if before[i] == after[j]:
            out[j] = dims[i]
            i, j = i + 1, j + 1
            continue
        first_j, a, b = j, before[i], after[j]
        lead = dims[i]
        i, j = i + 1, j + 1
        while a != b:
            if a < b:
                a *= before[i]
                i += 1
            else:
                b *= after[j]
                j += 1
        out[first_j] = lead
    return tuple(out)


class _Recorder(TorchFunctionMode):
    """Classifies every torch function called outside the recorded modules/operators."""

    def __init__(self, tracer: "Tracer"):
        super().__init__()
        self.tracer = tracer
        self.busy = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.busy and isinstance(out, torch.Tensor):
            self.tracer.tensor_calls += 1  # an operator every layout runs through DTensor's dispatch
        if self.tracer.depth == 0 and not self.busy:
            self.busy = True  # the bookkeeping itself calls torch functions (t.dim() ...): do not record those
            try:
                self.tracer.functional(func, args, kwargs, out)
            finally:
                self.busy = False
        return out


class Tracer:
    def __init__(self, network: torch.nn.Module, every_operator: bool = False):
        self.network = network
        # sharding propagation: every shardable operator is a node (its strategy is chosen), not just the heavy ones
        self.every_operator = every_operator
        self.nodes: list[OpNode] = []
        self.edges: list[tuple[int, int, int]] = []
        self.joins: list[tuple[int, int]] = []
        self.source: dict[int, Any] = {}
        self.dims: dict[int, tuple] = {}  # tensor id -> producer dimension per dimension (views of a node's output)
        self.edge_dims: dict = {}
        self.resolved: set[int] = set()  # ids of tensors a non-linear function made of a node's output
        self.edge_resolved: set = set()
        self.tensor_calls = 0  # torch functions that made a tensor, inside modules too
        self.keep: list[torch.Tensor] = []  # ids stay unique while the trace runs
        self._outside_inputs: dict[int, tuple[int, int]] = {}  # tensor id -> the first (node, input) it fed
        self.depth = 0
        self.other_flops = 0.0
        self.other_bytes = 0.0
        self.elementwise_bytes = 0.0
        self.names = {id(m): n for n, m in network.named_modules()}
        self.param_names = {id(p): n for n, p in network.named_parameters()}
        self.handles: list = []
        self._open: dict[int, OpNode] = {}  # id(module) -> the node its call opened (closed by the post hook)
        # ids of the tensors a gradient flows back into: made from a trainable parameter or an input that requires
        # one (the trace runs without autograd, so it follows them itself)
        self.grads: set[int] = set()
        self._node_grad: dict[int, bool] = {}  # node index -> does its output carry a gradient
        self.attention: list[tuple] = []  # SDPA calls: (query, key, value shapes, itemsize, causal, blockwise)
        self.attention_sources: list = []  # per SDPA call: the node its query comes from (None: none)
        self.experts: list[tuple] = []  # stacked experts modules: (module, parameter bytes, hidden shape, itemsize, E,
        # experts chosen per token)

    # -- sources ----------------------------------------------------------------------------------------------
    def _src(self, t: torch.Tensor) -> Any:
        return self.source.get(id(t), DP if t.dim() >= 1 else REP)

    def _set(self, out: Any, src: Any, grad: bool) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.source[id(t)] = src
                self.keep.append(t)
                if grad:
                    self.grads.add(id(t))

    def _flows(self, tensors, module: torch.nn.Module | None = None) -> bool:
        """Does a gradient flow back from what ``tensors`` (and ``module``'s own parameters) make?"""
        return any(id(t) in self.grads or (isinstance(t, torch.nn.Parameter) and t.requires_grad)
                   for t in tree_flatten(tensors)[0] if isinstance(t, torch.Tensor)) or (
            module is not None and any(p.requires_grad for p in module.parameters(recurse=False)))

    def _consume_dp(self, tensors) -> None:
        for t in tensors:
            src = self.source.get(id(t))
            if isinstance(src, int):
                self.nodes[src].out_to_dp += 1

    # -- node recording --------------------------------------------------------------------------------------
    def add_node(self, name, kind, target, spec, tensors, fixed, groups=1) -> OpNode:
        shapes = tuple(tuple(t.shape) for t in tensors)
        acts, pnames = [], []
        for i, t in enumerate(tensors):
            pname = self.param_names.get(id(t)) if isinstance(t, torch.nn.Parameter) else None
            pnames.append(pname)
            if pname is None:
                acts.append(i)
        node = OpNode(len(self.nodes), name, kind, target, spec, shapes, tuple(acts), tuple(pnames), (), 0.0,
                      tensors[0].element_size(), fixed,
                      no_grad_inputs=frozenset(i for i in acts if not self._flows([tensors[i]])))
        self._node_grad[node.index] = self._flows(tensors)
        for i in acts:
            src = self._src(tensors[i])
            node.in_sources[i] = src
            if not isinstance(src, int):
                first = self._outside_inputs.setdefault(id(tensors[i]), (node.index, i))
                if first != (node.index, i):
                    node.same_input[i] = first
                else:
                    self.keep.append(tensors[i])  # its id stays its own while the trace runs
            if isinstance(src, int):
                self.edges.append((src, node.index, i))
                if id(tensors[i]) in self.resolved:
                    self.edge_resolved.add((src, node.index, i))
                if id(tensors[i]) in self.dims:
                    self.edge_dims[(src, node.index, i)] = self.dims[id(tensors[i])]
        self.nodes.append(node)
        return node

    def finish_node(self, node: OpNode, out: torch.Tensor, groups: int = 1) -> None:
        node.out_shape = tuple(out.shape)
        node.flops = _flops(node.kind, node.shapes, node.out_shape, groups)
        self._set(out, node.index, self._node_grad.pop(node.index))

    # -- hooks ------------------------------------------------------------------------------------------------
    def _module_pre(self, module, args):
        self.depth += 1
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
            x = args[0]
            tensors = [x, module.weight] + ([module.bias] if module.bias is not None else [])
            kind = "linear" if isinstance(module, torch.nn.Linear) else "conv"
            op = module._autopar_op if isinstance(module, _Sharded) else (
                LinearOp() if kind == "linear" else Conv2dOp(module._conv_forward, module.groups))
            fixed = op.strategy if isinstance(module, _Sharded) else None
            self._open[id(module)] = self.add_node(self.names.get(id(module), type(module).__name__), kind,
                                                   module, op.spec(*tensors), tensors, fixed)
        else:
            if not isinstance(module, LAYOUT_TRANSPARENT):
                self._consume_dp([a for a in args if isinstance(a, torch.Tensor)])

    def _module_post(self, module, args, out):
        self.depth -= 1
        node = self._open.pop(id(module), None)
        if node is not None:
            self.finish_node(node, out, getattr(module, "groups", 1))
            return
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if isinstance(module, LAYOUT_TRANSPARENT) and tensors:
            self._set(out, self._src(tensors[0]), self._flows(tensors, module))
            if not isinstance(module, torch.nn.Identity) or id(tensors[0]) in self.resolved:
                self._resolve(out)
            self.elementwise_bytes += 2.0 * tensors[0].numel() * tensors[0].element_size()  # read + write
            return
        self._set(out, DP, self._flows(tensors, module))
        if stacked_experts(module) and tensors:
            chosen = tensors[1].shape[-1] if len(tensors) > 1 and tensors[1].dim() > 1 else 1  # top-k
            self.experts.append((module,
                                 float(sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))),
                                 tuple(tensors[0].shape), tensors[0].element_size(), module.num_experts, chosen))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.other_flops += 4.0 * t.numel()  # normalisation / pooling: a few operations per element
                self.other_bytes += t.numel() * t.element_size()

    def primitive(self, op, args, kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if any(getattr(node.target, "_autopar_op", None) is op for node in self._open.values()):
            return op.compute(*args, **kwargs)  # a sharded Linear/Conv2d's own operator: the module is the node
        heavy = isinstance(op, (MatMul, BatchMatMul, Softmax, FusedAttention))
        spec = op.spec(*args) if heavy or (self.every_operator and isinstance(op, ShardablePrimitive)
                                           and not getattr(op, "local", False) and tensors) else None
        if spec is not None and (heavy or _labels_fit(spec, args)):
            self.depth += 1
            kind = ("softmax" if isinstance(op, Softmax) else "attention" if isinstance(op, FusedAttention)
                    else "matmul" if heavy else "elementwise")
            node = self.add_node(self.names.get(id(op), type(op).__name__), kind, op, spec, tensors, op.strategy)
            out = op.compute(*args, **kwargs)
            self.depth -= 1
            self.finish_node(node, out)
            if kind == "attention" and op.window:  # a sliding window: the kernel's band of the causal triangle
                node.flops *= op.window_share(tensors[1].shape[2])
            return out
        self.depth += 1
        out = op.compute(*args, **kwargs)
        self.depth -= 1
        if isinstance(op, _CommPrimitive) and tensors:
            self._set(out, self._src(tensors[0]), self._flows(tensors))
        else:  # an operator without a strategy runs data-parallel
            self._consume_dp(tensors)
            self._set(out, DP, self._flows(tensors))
            self.other_flops += 2.0 * sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out

    def functional(self, func, args, kwargs, out) -> None:
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() >= 1]
        if not tensors or not any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]):
            if self._flows((args, kwargs)):  # a scalar made from the gradient's path stays on it
                self._set(out, self._src(out) if isinstance(out, torch.Tensor) else DP, True)
            return
        if func is torch.nn.functional.scaled_dot_product_attention and len(tensors) >= 3:
            q, k = tensors[0], tensors[1]
            causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
            heads = q.dim() == k.dim() == 4 and (q.shape[1] == k.shape[1] or (
                kwargs.get("enable_gqa", False) and q.shape[1] % k.shape[1] == 0))
            blockwise = (q.device.type == "cpu" and heads
                         and kwargs.get("attn_mask", args[3] if len(args) > 3 else None) is None)
            self.attention.append((tuple(q.shape), tuple(k.shape), tuple(tensors[2].shape), q.element_size(), causal,
                                   blockwise))
            source = self._src(q)
            self.attention_sources.append(source if isinstance(source, int) else None)
        first = self._src(tensors[0])
        name = getattr(func, "__name__", "")
        linear = name in _LINEAR or (name in _SCALED and len(tensors) == 1 and not any(
            isinstance(a, torch.Tensor) and a.dim() == 0 for a in tree_flatten((args, kwargs))[0]))
        if not linear or any(id(t) in self.resolved for t in tensors):
            self._resolve(out)
        if name not in _VIEWS:  # views move nothing; the rest reads and writes
            self.elementwise_bytes += sum(t.numel() * t.element_size() for t in tensors) + sum(
                o.numel() * o.element_size() for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor))
        if isinstance(first, int) and isinstance(out, torch.Tensor):
            self._follow_dims(func, tensors[0], out)
        elif isinstance(first, int) and isinstance(out, (tuple, list)):  # split / chunk: pieces keep the rank
            dims = self.dims.get(id(tensors[0]), tuple(range(tensors[0].dim())))
            for piece in out:
                if isinstance(piece, torch.Tensor) and piece.dim() == tensors[0].dim():
                    self.dims[id(piece)] = tuple(None if a != b else d
                                                 for a, b, d in zip(piece.shape, tensors[0].shape, dims))
        for other in tensors[1:]:
            src = self._src(other)
            if isinstance(src, int) and isinstance(first, int) and src != first:
                self.joins.append((first, src))
            elif isinstance(src, int) and not isinstance(first, int):
                self.nodes[src].out_to_dp += 1
            elif isinstance(first, int) and src == DP and other.shape == tensors[0].shape:
                self.nodes[first].out_to_dp += 1
        self._set(out, first, self._flows((args, kwargs)))

    def _resolve(self, out: Any) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.resolved.add(id(t))

    def _follow_dims(self, func, x: torch.Tensor, out: torch.Tensor) -> None:
        dims = self.dims.get(id(x), tuple(range(x.dim())))
        name = getattr(func, "__name__", "")
        if tuple(out.shape) == tuple(x.shape) and name not in ("transpose", "permute", "swapaxes"):
            mapped = dims  # element-wise, or a view that keeps the shape
        elif name in _VIEWS and out.numel() == x.numel():
            if name in ("transpose", "swapaxes", "permute"):
                mapped = self._permuted(func, x, out, dims)
            else:
                mapped = _view_dims(tuple(x.shape), tuple(out.shape), dims)
        elif out.dim() == x.dim():  # a slice, a concatenation, a pad: the dimensions whose size it keeps carry on
            # (RoPE's halves of a head-split query: lost, the query's heads read as its sequence after the
            # transpose back, and a column-split q before a row-split o as a resplit -- 39 ms a step on 4 ranks)
            mapped = tuple(d if a == b else None for d, a, b in zip(dims, x.shape, out.shape))
        else:
            return
        if mapped is not None and mapped != tuple(range(out.dim())):
            self.dims[id(out)] = mapped

    @staticmethod
    def _permuted(func, x, out, dims):
        # recover the permutation from strides: a transposed/permuted view reorders x's strides
        if out.dim() != x.dim():
            return None
        order = []
        for st, size in zip(out.stride(), out.shape):
            match = [d for d in range(x.dim()) if x.stride()[d] == st and x.shape[d] == size and d not in order]
            if not match:
                return None
            order.append(match[0])
        return tuple(dims[d] for d in order)

    # -- running ------------------------------------------------------------------------------------------------
    def run(self, fn, *inputs, **kwargs) -> Any:
        for module in self.network.modules():
            if isinstance(module, ShardablePrimitive) or not (
                    isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) or not any(True for _ in module.children())
                    or stacked_experts(module)):  # (transformers' MixtralExperts holds its activation as a child)
                continue
            self.handles.append(module.register_forward_pre_hook(self._module_pre))
            self.handles.append(module.register_forward_hook(self._module_post))
        try:
            with torch.no_grad(), _Recorder(self), _primitive.executing(self.primitive):
                for t in tree_flatten((inputs, kwargs))[0]:
                    if isinstance(t, torch.Tensor):
                        self._set(t, DP, t.requires_grad)
                out = fn(*inputs, **kwargs)
                self._consume_dp([t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)])
                return out
        finally:
            for h in self.handles:
                h.remove()


def capture(network: torch.nn.Module, loss_fn: torch.nn.Module | None, inputs: tuple,
            every_operator: bool = False, kwargs: dict | None = None) -> Graph:
    """Trace ``network`` (and ``loss_fn(network(*inputs[:-1]), inputs[-1])`` when a loss is given), called as the
    user calls it: ``kwargs`` are its keyword inputs (``input_ids=..., labels=...``); what it returns -- a tensor, a
    tuple, a dict or a ``ModelOutput``, a loss computed inside ``forward`` -- is taken whole.
    ``every_operator``: element-wise and reduction operators become nodes too (sharding propagation gives them
    strategies; the cost searches leave them data-parallel, as the runtime runs an operator without one)."""
    import time

    start = time.perf_counter()
    root = with_loss(network, loss_fn)
    was_training = root.training
    root.eval()  # no BatchNorm statistics are touched by the trace
    tracer = Tracer(root, every_operator)
    try:
        tracer.run(root, *inputs, **(kwargs or {}))
    finally:
        root.train(was_training)
    _mark_shared_parameters(root, tracer.nodes)
    first = next((t for t in tree_flatten((tuple(inputs), kwargs or {}))[0] if isinstance(t, torch.Tensor)), None)
    batch = int(first.shape[0]) if first is not None and first.dim() else 1
    lengths = {int(t.shape[1]) for t in tree_flatten((tuple(inputs), kwargs or {}))[0]
               if isinstance(t, torch.Tensor) and t.dim() >= 2}
    if loss_fn is not None:  # names as in the user's network
        for node in tracer.nodes:
            node.name = node.name.removeprefix("network.")
            node.param_names = tuple(p.removeprefix("network.") if p else p for p in node.param_names)
    return Graph(tracer.nodes, tracer.edges, tracer.edge_dims, tracer.joins, tracer.other_flops, tracer.other_bytes, batch,
                 time.perf_counter() - start, tracer.elementwise_bytes, tracer.tensor_calls + len(tracer.nodes),
                 frozenset(tracer.edge_resolved), tuple(tracer.attention), tuple(tracer.experts),
                 any(mixes_tokens(m) or not (any(True for _ in m.children()) or token_wise(m))
                     for m in network.modules()),
                 lengths.pop() if len(lengths) == 1 else None, tuple(tracer.attention_sources))


def _mark_shared_parameters(root: torch.nn.Module, nodes: list[OpNode]) -> None:
    """Each node's parameters that no strategy of its own may split (``OpNode.replicated_params``): one used by
    two modules or operators (each would lay it out its own way), or owned also by a module that is no node and
    calls no operator -- a leaf such as the ``nn.Embedding`` a GPT's output head is tied to, which the runtime keeps
    replicated."""
    from autopar.ops.primitive import Primitive

    params = dict(root.named_parameters())
    owners: dict[int, list] = {}
    for module in root.modules():
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(module)
    targets = {id(node.target) for node in nodes}
    users: dict[str, set] = {}  # (one module called twice -- a shared or recurrent layer -- is one strategy)
    for node in nodes:
        for name in node.param_names:
            if name:
                users.setdefault(name, set()).add(id(node.target))

    def kept_whole(module) -> bool:
        return (id(module) not in targets and not isinstance(module, Primitive)
                and not any(isinstance(c, Primitive) for c in module.children()))

    for node in nodes:
        node.replicated_params = frozenset(
            i for i, name in enumerate(node.param_names) if name and name in params
            and (len(users[name]) > 1 or any(kept_whole(m) for m in owners.get(id(params[name]), ()))))


def with_loss(network: torch.nn.Module, loss_fn: torch.nn.Module | None) -> torch.nn.Module:
    """The network and its loss as one module called ``(inputs..., label)`` -- as the capture traces them."""
    return network if loss_fn is None else _Pair(network, loss_fn)


class _Pair(torch.nn.Module):
    def __init__(self, network, loss_fn):
        super().__init__()
        self.network = network
        self.loss_fn = loss_fn

    def forward(self, *inputs, **kwargs):
        return call_loss(self.loss_fn, self.network(*inputs[:-1], **kwargs), inputs[-1])
