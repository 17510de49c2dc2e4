"""The PyTorch door to shard strategies: ``autopar.shard(module, strategy)`` for ``nn.Linear`` and ``nn.Conv2d``.

The module keeps its parameters and its state_dict; it gains a hidden operator (``_autopar_op``) whose dimension
labels say what a strategy means for it, and its class becomes a subclass whose ``forward`` calls that operator
with the module's parameters. Outside a parallel runtime the operator computes exactly the module's own forward.

- ``nn.Linear``: strategy ``((a, b), (c, b))`` for (input, weight) -- MindSpore's ``Dense`` convention (weight is
  (out, in)): ``((1, 1), (2, 1))`` splits the output features (Megatron column), ``((1, 2), (1, 2))`` the input
  features (row: partial sums). The bias follows the output features.
- ``nn.Conv2d``: ``((n, c, 1, 1), (o, c, 1, 1))``: batch, input channels (partial sums), output channels.
- transformers' ``Conv1D`` (GPT-2; weight (in, out), as MindSpore's ``MatMul``): ``((1, 1, 1), (1, 2))`` splits the
  output features, ``((1, 1, 2), (2, 1))`` the input features; the ``nn.Linear`` tuples, which fit only in Linear's
  (out, in) order, are taken in that meaning (said once).
- ``nn.Embedding``: ``((1, 1), (2, 1))`` splits the vocabulary (each rank looks up the ids in its rows, the others
  give zeros: partial sums), ``((1, 1), (1, 2))`` the embedding dimension.

Beside the tuples, the styles torch's tensor parallelism names: ``"colwise"`` / ``"rowwise"`` (``"vocab"`` for an
embedding's vocabulary split -- what ``RowwiseParallel`` does to an ``nn.Embedding``), or ``ColwiseParallel()`` /
``RowwiseParallel()`` objects; over every rank, for inputs of any rank. And a whole model by module names, as
torchtitan plans are written: ``autopar.shard(model, {"*.q_proj": "colwise", "*.o_proj": "rowwise"})``
(``fnmatch`` patterns over ``named_modules()``; one that matches no module is an error).

Sequence parallelism (Korthikanti et al. 2022), as torchtitan plans it: ``"sequence"`` or ``SequenceParallel()`` on
a norm or dropout (a token-wise module without children) splits its input's sequence dimension over every rank -- the norms,
dropouts and residual adds between tensor-parallel layers then hold 1/n of the activations, and the all-reduce after
a row-parallel layer becomes a reduce-scatter (the all-gather comes before the next column-parallel one).
``RowwiseParallel(output_layouts=Shard(1))`` reduce-scatters its output at once, ``ColwiseParallel(output_layouts=
Replicate())`` gathers it, and ``PrepareModuleInput(desired_input_layouts=...)`` on a block redistributes its inputs
once (a Llama's q, k and v then share one all-gather). ``"expert"`` (torchtitan's ``ExpertParallel()``) on a
module of stacked expert weights spreads its experts over the ranks (:mod:`autopar.parallel.tensor.experts`). The
MindSpore spelling of the sequence split: a one-entry strategy on such a
module, ``shard(norm, ((dp, mp, 1),))`` or ``cell.shard(((dp, mp, 1),))``. The runtime is
:mod:`autopar.parallel.tensor.sequence`.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.nn.functional as F

from autopar.errors import StrategyError
from autopar.layout import spec as S
from autopar.layout.leaves import stacked_experts
from autopar.ops.math import ShardablePrimitive


class LinearOp(ShardablePrimitive):
    bias_index = 2  # when the contraction is split, each part adds 1/k of the bias (see SemiAutoRuntime.run_op)

    def spec(self, x, weight, bias=None) -> S.OpSpec:
        batch = "abcdefgh"[: x.dim() - 1]
        inputs = (batch + "k", "jk") + (("j",) if bias is not None else ())
        return S.OpSpec(inputs, batch + "j")

    def compute(self, x, weight, bias=None):
        return F.linear(x, weight, bias)


class Conv2dOp(ShardablePrimitive):
    bias_index = 2

    def __init__(self, conv_forward, groups: int):
        super().__init__()
        self.__dict__["_conv_forward"] = conv_forward  # a bound method, not a submodule (no module cycle)
        self.groups = groups

    def spec(self, x, weight, bias=None) -> S.OpSpec:
        inputs = ("nchw", "ocyx") + (("o",) if bias is not None else ())
        fixed = "hwyx" + ("co" if self.groups != 1 else "")
        return S.OpSpec(inputs, "nohw", unsplittable=frozenset(fixed))

    def compute(self, x, weight, bias=None):
        return self._conv_forward(x, weight, bias)


class Conv1DOp(ShardablePrimitive):
    """transformers' ``Conv1D`` (GPT-2's projections): ``x @ weight + bias`` with the weight stored (in, out)."""

    bias_index = 2

    def spec(self, x, weight, bias=None) -> S.OpSpec:
        batch = "abcdefgh"[: x.dim() - 1]
        inputs = (batch + "k", "kj") + (("j",) if bias is not None else ())
        return S.OpSpec(inputs, batch + "j")

    def compute(self, x, weight, bias=None):
        flat = x.reshape(-1, x.shape[-1])  # as Conv1D computes it (addmm): the same rounding
        out = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
        return out.view(*x.shape[:-1], weight.shape[-1])


class EmbeddingOp(ShardablePrimitive):
    """``nn.Embedding``'s lookup. With the vocabulary split each rank holds rows ``[start, start + rows)``: the ids
    outside give zeros (the output is a partial sum over the ranks); the runtime passes ``start`` (None: whole)."""

    vocab_offset = True

    def __init__(self, padding_idx: int | None = None):
        super().__init__()
        self.padding_idx = padding_idx

    def spec(self, ids, weight) -> S.OpSpec:
        idx = "nopqrs"[: ids.dim()]
        return S.OpSpec((idx, "vh"), idx + "h")

    def compute(self, ids, weight, start: int | None = None):
        rows = weight.shape[0]
        pad = self.padding_idx
        if start is None:  # the whole table here
            return F.embedding(ids, weight, pad)
        local = ids - start
        inside = (local >= 0) & (local < rows)
        pad = pad - start if pad is not None and 0 <= pad - start < rows else None
        out = F.embedding(torch.where(inside, local, torch.zeros_like(local)), weight, pad)
        return out * inside.unsqueeze(-1).to(out.dtype)


def _is_conv1d(module: Any) -> bool:
    """transformers' ``Conv1D``, recognised without importing transformers."""
    return (isinstance(module, torch.nn.Module) and any(c.__name__ == "Conv1D" for c in type(module).__mro__)
            and hasattr(module, "nf")
            and getattr(module, "weight", None) is not None and module.weight.dim() == 2)


class _Sharded:
    """Mixin: forward through the module's ``_autopar_op`` (a style's strategy fitted to the input's rank)."""

    def forward(self, x):  # type: ignore[override]
        style = getattr(self, "_autopar_style", None)
        if style is not None:
            strategy = _style_strategy(self, style, x.dim())
            if self._autopar_op.strategy != strategy:
                self._autopar_op.strategy = strategy
        if isinstance(self, torch.nn.Embedding):
            out = self._autopar_op(x, self.weight)
        elif self.bias is not None:
            out = self._autopar_op(x, self.weight, self.bias)
        else:
            out = self._autopar_op(x, self.weight)
        return _laid_out_as(out, getattr(self, "_autopar_output_layout", None))


def _laid_out_as(out: Any, layout: Any) -> Any:
    """A style's declared output layout (``RowwiseParallel(output_layouts=Shard(1))``: reduce-scattered onto the
    sequence now, not lazily; ``ColwiseParallel(output_layouts=Replicate())``: gathered) -- over every rank, as the
    styles are. Outside a layout runtime the output is a plain tensor, already whole."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if layout is None or not isinstance(out, DTensor):
        return out
    if isinstance(layout, Shard):
        layout = Shard(layout.dim % out.dim())
    target = tuple(layout if isinstance(layout, (Shard, Replicate)) else Replicate() for _ in out.placements)
    if tuple(out.placements) == target:
        return out
    moved = out.redistribute(out.device_mesh, target)
    # where it came from: an operator that saves this gathered copy for its backward may keep the split one instead
    # and gather again then (sequence parallelism's activations, Megatron's way: autopar.parallel.tensor.operators)
    moved._autopar_gathered_from = (out, moved._local_tensor._version)  # (changed in place since: not used)
    return moved


_SHARDED_CLASSES: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    if cls not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[cls] = type(f"Sharded{cls.__name__}", (_Sharded, cls), {"__module__": cls.__module__})
    return _SHARDED_CLASSES[cls]


def _with_bias_entry(strategy: Any, bias_split: int, has_bias: bool) -> tuple:
    strategy = tuple(tuple(s) for s in strategy)
    if has_bias and len(strategy) == 2:
        strategy += ((bias_split,),)
    return strategy


_STYLES = {"colwise", "rowwise", "vocab", "sequence", "expert"}
_TORCH_STYLES = {"ColwiseParallel": "colwise", "RowwiseParallel": "rowwise", "SequenceParallel": "sequence",
                 "ExpertParallel": "expert"}  # torchtitan's ExpertParallel


def _style_of(value: Any) -> str | None:
    """``"colwise"`` / ``"rowwise"`` / ``"vocab"`` / ``"sequence"``, or torch's ``ColwiseParallel()`` /
    ``RowwiseParallel()`` / ``SequenceParallel()``."""
    if isinstance(value, str):
        if value not in _STYLES:
            raise StrategyError(f"autopar.shard: style {value!r} is not one of {', '.join(sorted(_STYLES))}")
        return value
    name = type(value).__name__
    if name in _TORCH_STYLES:
        return _TORCH_STYLES[name]
    if name == "PrepareModuleOutput":
        raise StrategyError("autopar.shard: PrepareModuleOutput is not available; the layouts between operators are "
                            "redistributed as needed (give the next module's layout, or PrepareModuleInput)")
    return None


def _declared_output(value: Any, style: str) -> Any:
    """The output layout a torch style object declares where it differs from what the split gives lazily (a
    row-parallel partial sum is resolved by its consumer; a column split stays split): ``RowwiseParallel``'s
    ``Shard(d)``, ``ColwiseParallel``'s ``Replicate()``. None for the strings and the defaults."""
    from torch.distributed.tensor import Replicate, Shard

    layouts = getattr(value, "output_layouts", None)
    layout = layouts[0] if isinstance(layouts, tuple) and layouts else None
    if style == "rowwise" and isinstance(layout, Shard):
        return layout
    if style == "colwise" and isinstance(layout, Replicate):
        return layout
    return None


def _style_strategy(module: Any, style: str, x_dim: int) -> tuple:
    """The MindSpore tuple a style stands for on ``module`` over every rank, for an input of rank ``x_dim``."""
    from autopar.comm.topology import world_size

    n = world_size()
    lead = (1,) * max(x_dim - 1, 0)
    if isinstance(module, torch.nn.Embedding):
        ids = (1,) * x_dim
        return (ids, (n, 1)) if style in ("vocab", "rowwise") else (ids, (1, n))
    if style == "vocab":
        raise StrategyError(f"autopar.shard: 'vocab' splits an nn.Embedding's vocabulary, not a "
                            f"{type(module).__name__}'s (give colwise: its output features)")
    conv1d = _is_conv1d(module)
    if style == "colwise":
        strategy = (lead + (1,), (1, n) if conv1d else (n, 1))
    else:
        strategy = (lead + (n,), (n, 1) if conv1d else (1, n))
    bias = getattr(module, "bias", None) is not None
    return strategy + (((n if style == "colwise" else 1,),) if bias else ())


def shard(module: Any, in_strategy: Any, out_strategy: Any = None) -> Any:
    """Give ``module`` a MindSpore shard strategy (an autopar operator, ``nn.Linear``, ``nn.Conv2d``,
    transformers' ``Conv1D``, ``nn.Embedding``) or a style; or a whole model a plan by module names."""
    if isinstance(module, ShardablePrimitive):
        return module.shard(in_strategy, out_strategy)
    if isinstance(in_strategy, dict):
        return _shard_by_names(module, in_strategy)
    if type(in_strategy).__name__ == "PrepareModuleInput":
        return _prepare_input(module, in_strategy)
    if isinstance(in_strategy, tuple) and len(in_strategy) == 2 and in_strategy[0] == "expert":
        return split_experts(module, in_strategy[1])  # ("expert", ep): over groups of ep consecutive ranks
    style = _style_of(in_strategy)
    if style == "expert":
        return split_experts(module)
    if style == "sequence" or (style is None and _splits_a_leaf(module, in_strategy)):
        if out_strategy is not None:
            raise StrategyError(f"{type(module).__name__}: a sequence split takes no out_strategy (the output keeps "
                                "the input's layout)")
        return split_leaf(module, getattr(in_strategy, "sequence_sharding", None) if style else in_strategy)
    conv1d = _is_conv1d(module)
    if isinstance(module, _Sharded):
        base = module._autopar_op
    elif isinstance(module, torch.nn.Linear):
        base = LinearOp()
    elif isinstance(module, torch.nn.Conv2d):
        base = Conv2dOp(module._conv_forward, module.groups)
    elif conv1d:
        base = Conv1DOp()
    elif isinstance(module, torch.nn.Embedding):
        if module.max_norm is not None or module.sparse:
            raise StrategyError("autopar.shard: an nn.Embedding with max_norm or sparse=True cannot be sharded "
                                "(its lookup renormalises or scatters the whole table)")
        base = EmbeddingOp(module.padding_idx)
    else:
        raise StrategyError(f"autopar.shard cannot shard a {type(module).__name__}: supported are nn.Linear, "
                            "nn.Conv2d, nn.Embedding, transformers' Conv1D and the autopar.ops operators; a norm or "
                            "dropout splits on the sequence (\"sequence\", or ((dp, mp, 1),))")
    if style is not None:
        if out_strategy is not None:
            raise StrategyError(f"{type(module).__name__}: a style ({style}) takes no out_strategy")
        base.shard(_style_strategy(module, style, 2 if isinstance(module, torch.nn.Embedding) else 3))
    else:
        if not isinstance(in_strategy, (tuple, list)) or len(in_strategy) < 2:
            raise StrategyError(f"{type(module).__name__}: the strategy needs an entry for the input and the weight, "
                                f"got {in_strategy!r}")
        if conv1d:
            in_strategy = _conv1d_order(in_strategy)
        has_bias = getattr(module, "bias", None) is not None
        out_dim = 1 if conv1d else 0  # the bias follows the output features
        base.shard(_with_bias_entry(in_strategy, tuple(in_strategy[1])[out_dim], has_bias), out_strategy)
    if not isinstance(module, _Sharded):
        module._autopar_op = base
        module.__class__ = _sharded_class(type(module))
    module._autopar_style = style
    module._autopar_output_layout = _declared_output(in_strategy, style) if style else None
    return module


_SPLIT_ELSEWHERE = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Embedding)


def _splits_a_leaf(module: Any, strategy: Any) -> bool:
    """A one-entry strategy (the input's) on a module without children that is not one of the layers split by
    weights: MindSpore's ``norm.shard(((dp, mp, 1),))``, a sequence split."""
    return (isinstance(module, torch.nn.Module) and not isinstance(module, (*_SPLIT_ELSEWHERE, _Sharded))
            and not _is_conv1d(module) and isinstance(strategy, (tuple, list)) and len(strategy) == 1
            and isinstance(strategy[0], (tuple, list)))


def split_leaf(module: Any, split: Any) -> Any:
    """Mark a norm / dropout / other token-wise module without children to run on its input split as ``split`` says: a strategy
    tuple for its first input (``((dp, mp, 1),)``), or torch's ``sequence_sharding`` (``(Shard(1),)``: that dimension
    over every rank), or None (dimension 1 over every rank). Its parameters stay whole; the runtime
    (:mod:`autopar.parallel.tensor.sequence`) splits the input and completes their gradients."""
    if not isinstance(module, torch.nn.Module) or isinstance(module, (*_SPLIT_ELSEWHERE, _Sharded)) \
            or _is_conv1d(module):
        raise StrategyError(f"autopar.shard: a sequence split is for norms and dropout between tensor-parallel layers, "
                            f"not a {type(module).__name__} (give it colwise / rowwise)")
    if any(True for _ in module.children()):
        raise StrategyError(f"autopar.shard: a sequence split runs one module without children on its slice of the "
                            f"sequence; {type(module).__name__} has children: split its norms and dropouts by name")
    from autopar.layout.leaves import mixes_tokens

    if mixes_tokens(module):
        raise StrategyError(f"autopar.shard: a {type(module).__name__} combines positions along the sequence and "
                            "cannot run on a slice of it: split the norms and dropouts around it")
    if split is None or (isinstance(split, tuple) and split and type(split[0]).__name__ == "Shard"):
        module._autopar_split = ("sequence", split[0].dim if split else 1)
    else:
        entry = tuple(split[0])
        if not all(isinstance(k, int) and k >= 1 for k in entry):
            raise StrategyError(f"autopar.shard: {type(module).__name__}: strategy {tuple(split)} needs positive "
                                "integers, one per dimension of the input")
        module._autopar_split = ("strategy", entry)
    return module


def split_experts(module: Any, degree: int | None = None) -> Any:
    """Mark a module of stacked expert weights (Hugging Face's ``MixtralExperts``: parameters ``[num_experts, ...]``,
    ``forward(hidden_states, top_k_index, top_k_weights)``) to keep only its rank's experts, spread over groups of
    ``degree`` consecutive ranks (every rank where None); the runtime is :mod:`autopar.parallel.tensor.experts`."""
    if not stacked_experts(module):
        raise StrategyError(f"autopar.shard: 'expert' splits a module of stacked expert weights (num_experts and "
                            f"parameters [num_experts, ...], as transformers' MixtralExperts), not a "
                            f"{type(module).__name__}")
    if degree is not None and (isinstance(degree, bool) or not isinstance(degree, int) or degree < 1):
        raise StrategyError(f"autopar.shard: an expert-parallel degree must be a positive integer, got {degree!r}")
    module._autopar_experts = degree or True
    return module


def _prepare_input(module: Any, prepare: Any) -> Any:
    """torch's ``PrepareModuleInput`` on a block: its inputs redistributed to ``desired_input_layouts`` (and
    ``desired_input_kwarg_layouts``) at each call, over every rank -- once for every layer inside (a Llama's q, k
    and v projections share one all-gather of the sequence-split input instead of three)."""
    if not isinstance(module, torch.nn.Module):
        raise StrategyError(f"autopar.shard: PrepareModuleInput needs a torch module, got {type(module).__name__}")
    desired = tuple(prepare.desired_input_layouts or ())
    desired_kw = dict(prepare.desired_input_kwarg_layouts or {})

    def pre(mod, args, kwargs):
        args = tuple(_laid_out_as(a, d) if d is not None else a for a, d in zip(args, desired)) + args[len(desired):]
        kwargs = {k: _laid_out_as(v, desired_kw.get(k)) for k, v in kwargs.items()}
        return args, kwargs

    handle = getattr(module, "_autopar_prepare", None)
    if handle is not None:
        handle.remove()
    module._autopar_prepare = module.register_forward_pre_hook(pre, with_kwargs=True)
    return module


def _conv1d_order(strategy: Any) -> tuple:
    """transformers' ``Conv1D`` stores its weight (in, out) -- MindSpore's ``MatMul`` order -- where ``nn.Linear``
    stores (out, in). A tuple whose weight entry only fits the input read in Linear's order (the same GPT-2 split
    written as for a Llama) is taken in that meaning, and said once; one that fits neither order is one line naming
    Conv1D's column and row tuples."""
    x, weight = tuple(strategy[0]), tuple(strategy[1])
    if len(weight) != 2 or not x or x[-1] == weight[0]:
        return tuple(strategy)
    if x[-1] != weight[1]:
        n = max(max(x), max(weight))
        rows, cols = f"(({', '.join(['1'] * (len(x) - 1) + [str(n)])}), ({n}, 1))", \
            f"(({', '.join(['1'] * len(x))}), (1, {n}))"
        raise StrategyError(f"transformers' Conv1D: strategy {tuple(strategy)} splits the contracted features "
                            f"differently in the input ({x[-1]}) and the weight ({weight[0]}): Conv1D stores its weight "
                            f"(in, out), so columns are {cols} and rows {rows}")
    taken = (x, weight[::-1], *strategy[2:])
    from autopar.errors import warn_once

    warn_once(f"conv1d-order-{strategy}", f"transformers' Conv1D stores its weight (in, out): strategy "
              f"{tuple(strategy)} reads as nn.Linear's (out, in) order and is taken as {taken} "
              f"({'columns' if x[-1] == 1 else 'rows'}); write it so to say it in Conv1D's order")
    return taken


def _shard_by_names(model: Any, plan: dict) -> Any:
    """``{pattern: style or strategy}`` over the model's module names (``fnmatch``), every pattern used."""
    if not isinstance(model, torch.nn.Module):
        raise StrategyError(f"autopar.shard: a plan by names needs a torch module, got {type(model).__name__}")
    modules = list(model.named_modules())
    for pattern, value in plan.items():
        if not isinstance(pattern, str):
            raise StrategyError(f"autopar.shard: plan keys are module-name patterns, got {pattern!r}")
        matched = [m for name, m in modules if name and fnmatchcase(name, pattern)]
        if not matched:
            raise StrategyError(f"autopar.shard: pattern {pattern!r} matches no module of the "
                                f"{type(model).__name__}")
        for m in matched:
            shard(m, value)
    return model


def has_strategies(*modules: torch.nn.Module | None, splits: bool = True, experts: bool = True) -> bool:
    """Does any operator or module carry a shard strategy (a sequence split counted unless ``splits=False``, experts
    spread over ranks unless ``experts=False``)?"""
    for root in modules:
        if not isinstance(root, torch.nn.Module):  # None, or a loss given as a function
            continue
        for m in root.modules():
            if getattr(m, "_autopar_op", None) is not None:
                return True
            if isinstance(m, ShardablePrimitive) and m.strategy is not None:
                return True
            if splits and getattr(m, "_autopar_split", None) is not None:
                return True
            if experts and getattr(m, "_autopar_experts", False):
                return True
    return False
