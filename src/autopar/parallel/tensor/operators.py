"""How one autopar operator runs under layouts (:meth:`SemiAutoRuntime.run_op`): its inputs are redistributed to the
layouts its strategy demands, it computes on the *local shards* with plain torch, and its output is wrapped with the
layout the strategy implies (a split contracted dimension gives a partial sum, resolved lazily by the next
consumer's redistribution). Running the unsharded operator and slicing afterwards never happens."""
from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.comm.topology import world_mesh
from autopar.errors import StrategyError
from autopar.layout.layout import Layout
from autopar.layout.strategy import data_parallel_strategy, derive_plan
from autopar.ops.math import OneHot, Reshape
from autopar.ops.primitive import Primitive
from autopar.parallel.tensor import placements as P
from autopar.parallel.tensor.regather import Regather, version


def run_operator(rt, op: Primitive, args: tuple, kwargs: dict) -> Any:
    """``op`` called with ``args`` while runtime ``rt`` runs its network."""
    if isinstance(op, Reshape):
        x, shape = args[0], args[1]
        x = x if isinstance(x, DTensor) else P.to_dtensor_replicated(x)
        return x.reshape(tuple(shape))
    if isinstance(op, OneHot):
        return _one_hot(rt, op, *args)
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if not positions:
        return op.compute(*args, **kwargs)
    spec = op.spec(*args)
    shapes = tuple(tuple(args[i].shape) for i in positions)
    strategy = op.strategy or data_parallel_strategy(spec, shapes, rt.device_num)
    plan = _plan(rt, op, spec, strategy, shapes, [args[i] for i in positions])
    local_args = list(args)
    mesh = world_mesh()
    regather = Regather() if rt.zero_level == "level3" or rt.sequence_parallel else None
    for k, i in enumerate(positions):
        layout = plan.inputs[k]
        dt = stored = rt._input(args[i], op, plan, layout)
        target = layout.placements()
        if tuple(dt.placements) != target:
            dt = dt.redistribute(mesh, target)
        grad_placements = P.placements_for(layout, plan.absent_axes(k), grad_partial=True)
        local_args[i] = dt.to_local(grad_placements=grad_placements)
        if regather is None:
            continue
        if isinstance(stored, torch.nn.Parameter):
            if dt is not stored and rt.zero_level == "level3":
                regather.add(local_args[i], stored, target)  # ZeRO-3: gathered again for the backward
        elif rt.sequence_parallel and not _outer_saved_hooks():  # (checkpointing's hooks stay in charge)
            source = stored if dt is not stored else _gathered_from(args[i])
            if isinstance(source, DTensor) and _gathers(source.placements, target):
                regather.add(local_args[i], source, target, rt.name_of(op))  # the split kept, gathered again
    bias = getattr(op, "bias_index", None)
    if plan.partial_axes and bias is not None and bias < len(local_args) and local_args[bias] is not None:
        # the output is a partial sum over the split contraction: each part carries 1/k of the bias
        parts = math.prod(plan.device_matrix[a] for a in plan.partial_axes)
        local_args[bias] = local_args[bias] / parts
    if getattr(op, "vocab_offset", False) and plan.inputs[1].slice_shape[0] != shapes[1][0]:
        # a table split by rows (an embedding's vocabulary): the operator looks up the ids in its rows only
        rank = dist.get_rank() if dist.is_initialized() else 0
        kwargs = dict(kwargs, start=plan.inputs[1].slice_index(rank)[0] * plan.inputs[1].slice_shape[0])
    with regather if regather is not None and regather.gathered else contextlib.nullcontext():
        out = op.compute(*local_args, **kwargs)
    partial, reduction = plan.partial_axes, plan.reduction
    if partial and reduction in ("max", "min"):
        out = P.all_reduce_extreme(out, plan.device_matrix, partial, reduction)
        partial = ()
    elif partial and reduction == "avg":
        # a mean of k equal parts = the sum of (local mean / k). Emitting Partial(sum) keeps the backward exact:
        # DTensor hands a Partial(avg) input the whole gradient, k times too much for a mean taken locally.
        out = out / math.prod(plan.device_matrix[a] for a in partial)
        reduction = "sum"
    return P.wrap_local(out, P.output_placements(plan.device_matrix, plan.output_map, partial, reduction))


def _gathered_from(t) -> DTensor | None:
    """The split DTensor a style's declared layout gathered ``t`` from (``ops.shard._laid_out_as``) -- unless ``t``
    was changed in place since, when the split no longer holds its values."""
    noted = getattr(t, "_autopar_gathered_from", None)
    return noted[0] if noted is not None and version(t) == noted[1] else None


# saved-tensor hooks that manage memory themselves -- torch's non-reentrant checkpointing (its forward's and its
# recomputation's hooks: the recomputation must save what the forward saved) and ``save_on_cpu``: the regathering
# hooks would take their place inside the operator
_MEMORY_HOOKS = ("_checkpoint_hook.", "_recomputation_hook.", "save_on_cpu.")


def _outer_saved_hooks() -> bool:
    """Are saved-tensor hooks that manage memory active around this operator?"""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith(_MEMORY_HOOKS)


def _gathers(source: tuple, target: tuple) -> bool:
    """Is moving from ``source`` to ``target`` placements an all-gather (a split made whole on some mesh axis, no
    partial sum)? Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2): the column-parallel layer's input,
    gathered from the sequence split, is not kept whole for the backward -- the split is kept and gathered again
    there, as Megatron-LM does, so the activations between tensor-parallel layers take 1/t of the memory."""
    return not any(p.is_partial() for p in source) and any(
        P.splits(s) and not P.splits(t) for s, t in zip(source, target))


def _plan(rt, op: Primitive, spec, strategy: tuple, shapes: tuple, tensors: list | None = None):
    """The operator's plan; a strategy that does not fit, when a strategy file gave it, names that file and the
    shapes the operator was called with (the file was written for another network or other inputs) -- or, where
    one of its parameters has another shape in the file, that parameter and both shapes."""
    try:
        return derive_plan(rt.name_of(op), spec, strategy, shapes, rt.device_num)
    except StrategyError as exc:
        path = getattr(op, "_autopar_strategy_file", None)
        if path is None:
            said = in_users_words(rt, op, strategy, shapes, exc)
            if said is None:
                raise
            raise StrategyError(said) from None
        names = {id(p): n for n, p in rt.parameters()}
        for t in tensors or ():
            name = names.get(id(t)) if isinstance(t, torch.nn.Parameter) else None
            if name is not None:
                rt.loaded.check_shape(name, tuple(t.shape))
        raise StrategyError(f"the strategy file {path} cannot be applied to this network: {exc}; the operator's "
                            f"inputs here have shapes {', '.join(str(tuple(s)) for s in shapes)}") from None


# What each dimension of a sharded module's operator is, in the module's own terms: (input, dimension) -> words
_DIMENSIONS = {
    "LinearOp": {(1, 0): "output features", (1, 1): "input features", (2, 0): "output features"},
    "Conv1DOp": {(1, 0): "input features", (1, 1): "output features", (2, 0): "output features"},
    "Conv2dOp": {(1, 0): "output channels", (1, 1): "input channels", (2, 0): "output channels"},
    "EmbeddingOp": {(1, 0): "vocabulary rows", (1, 1): "embedding dimension"},
}


def _dimension(op: Primitive, i: int, d: int, rank: int) -> str:
    """Dimension ``d`` of input ``i`` (of ``rank`` dimensions) of a module's operator, in the module's terms."""
    kind = type(op).__name__
    if i == 0 and kind in ("LinearOp", "Conv1DOp"):
        return "input features" if d == rank - 1 else f"input's dimension {d}"
    if i == 0 and kind == "Conv2dOp":
        return {0: "batch", 1: "input channels"}.get(d, f"input's dimension {d}")
    return _DIMENSIONS.get(kind, {}).get((i, d), f"input {i}'s dimension {d}")


def in_users_words(rt, op: Primitive, strategy: tuple, shapes: tuple, exc: StrategyError) -> str | None:
    """A strategy that does not fit a module the user split with ``autopar.shard``, said as the user wrote it: the
    module's name and type, the user's spelling (``"colwise"`` or the tuple) and which of its sizes does not divide.
    None for an operator no module owns (MindSpore's ``ops.MatMul().shard(...)``: its own message says it)."""
    owner = next(((name, m) for root in rt.roots for name, m in root.named_modules()
                  if getattr(m, "_autopar_op", None) is op), None)
    if owner is None:
        return None
    name, module = owner
    style = getattr(module, "_autopar_style", None)
    spelled = f'"{style}"' if style else str(tuple(tuple(s) for s in strategy))
    what = f"module '{name}' ({type(module).__name__.removeprefix('Sharded')}) split {spelled}"
    for i, (entry, shape) in enumerate(zip(strategy, shapes)):
        for d, split in enumerate(entry):
            size = shape[d] if d < len(shape) else 1
            if split > 1 and size % split:
                return (f"{what} over {split} ranks: its {_dimension(op, i, d, len(shape))} ({size}) cannot be split "
                        f"into {split} parts (make it a multiple of {split}, or leave the module whole)")
    return f"{what}: {str(exc).split(': ', 1)[-1]}"  # the operator's own reason, after its internal name


def _one_hot(rt, op: OneHot, indices, depth, on_value, off_value):
    depth = int(depth)
    shape = tuple(indices.shape) + (depth,)
    spec = op.spec(indices, depth, on_value, off_value)
    strategy = op.strategy or data_parallel_strategy(spec, [shape, (), ()], rt.device_num)
    plan = derive_plan(rt.name_of(op), spec, strategy, (shape, (), ()), rt.device_num)
    out_layout = plan.inputs[0]
    idx_layout = Layout(plan.device_matrix, out_layout.tensor_map[:-1], shape[:-1])
    idx = indices if isinstance(indices, DTensor) else P.to_dtensor_replicated(indices)
    idx = idx.redistribute(world_mesh(), idx_layout.placements()).to_local()
    rank = dist.get_rank() if dist.is_initialized() else 0
    part = out_layout.slice_shape[-1]
    start = out_layout.slice_index(rank)[-1] * part
    columns = torch.arange(start, start + part, device=idx.device)
    on = on_value.full_tensor() if isinstance(on_value, DTensor) else torch.as_tensor(on_value)
    off = off_value.full_tensor() if isinstance(off_value, DTensor) else torch.as_tensor(off_value)
    hot = (idx.long().unsqueeze(-1) == columns).to(on.dtype)
    return P.wrap_local(hot * (on - off) + off, out_layout.placements())
