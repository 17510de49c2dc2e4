"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"):
the norms, dropouts and residual adds between tensor-parallel layers run on a slice of the sequence.

A module marked by :func:`autopar.ops.shard.split_leaf` (``"sequence"`` / ``SequenceParallel()`` / a one-entry
strategy such as ``((dp, mp, 1),)``) runs, under a layout runtime, on its input laid out as its strategy says: the
sequence split over the tensor-parallel ranks (and the batch over the data-parallel ones). What that does to the
communication follows from the layouts alone, as in Megatron-LM:

- the row-parallel layer before it leaves a partial sum; bringing that onto the split sequence is a
  reduce-scatter (where tensor parallelism alone all-reduces);
- the column-parallel layer after it needs the whole sequence: an all-gather;
- the residual adds in between meet two sequence-split tensors and stay split.

So every rank holds 1/t of those activations. The module's parameters stay whole on every rank; each rank's gradient
is its slice's part of the sum, completed over the ranks that split the input (replicated over the others).
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_flatten, tree_map

from autopar.comm.topology import world_mesh
from autopar.errors import StrategyError
from autopar.layout import spec as S
from autopar.layout.layout import Layout
from autopar.layout.leaves import mixes_tokens
from autopar.layout.strategy import derive_plan
from autopar.parallel.tensor import placements as P


def is_split(module: torch.nn.Module) -> bool:
    return getattr(module, "_autopar_split", None) is not None


def strategy_of(module: torch.nn.Module, ndim: int, device_num: int) -> tuple[int, ...]:
    """The module's split of an input of ``ndim`` dimensions: its strategy, or ``SequenceParallel``'s sequence
    dimension over every rank."""
    kind, value = module._autopar_split
    if kind == "strategy":
        return tuple(value)
    dim = value % ndim if ndim else 0
    return tuple(device_num if d == dim else 1 for d in range(ndim))


def _words(name: str, module: torch.nn.Module, strategy: tuple, shape: tuple, device_num: int) -> str:
    """Why ``strategy`` does not fit the module's input, as the user wrote it."""
    what = f"module '{name}' ({type(module).__name__}) split {strategy} over {device_num} ranks"
    if len(strategy) != len(shape):
        return (f"{what}: the strategy has {len(strategy)} values but the module's input has {len(shape)} dimensions "
                f"(shape {shape})")
    if len(strategy) and strategy[-1] > 1:
        return f"{what}: its last dimension (the features it normalises) stays whole -- split the sequence: (dp, mp, 1)"
    for d, (k, size) in enumerate(zip(strategy, shape)):
        if k > 1 and size % k:
            part = "sequence" if d == 1 else f"dimension {d}"
            return (f"{what}: its {part} ({size}) cannot be split into {k} parts (make it a multiple of {k}, or "
                    "leave the module whole)")
    return ""


def input_layout(rt, module: torch.nn.Module, x: torch.Tensor) -> Layout:
    shape = tuple(x.shape)
    strategy = strategy_of(module, len(shape), rt.device_num)
    name = rt.names.get(id(module), type(module).__name__)
    said = _words(name, module, strategy, shape, rt.device_num)
    if said:
        raise StrategyError(said)
    labels = S.LETTERS[:len(shape)]
    spec = S.OpSpec((labels,), labels, unsplittable=frozenset(labels[-1:]))
    try:
        return derive_plan(name, spec, (strategy,), (shape,), rt.device_num).inputs[0]
    except StrategyError as exc:
        raise StrategyError(f"module '{name}' ({type(module).__name__}) split {strategy}: "
                            f"{str(exc).split(': ', 1)[-1]}") from None


def follows(args) -> bool:
    """Under context parallelism: does a module get a tensor split on its sequence (dimension 1)? It then runs on
    that split, as a token-wise module does."""
    return any(isinstance(t, DTensor) and t.dim() >= 2 and any(isinstance(p, Shard) and p.dim == 1
                                                                for p in t.placements)
               for t in tree_flatten((args,))[0])


def _within_slices(x: torch.Tensor, placements: tuple) -> tuple:
    """Sequence parallelism beside context parallelism: the module's split of the sequence taken *within* each
    rank's context-parallel slice, as Megatron-LM splits it (the tensor-parallel ranks split their slice; nothing
    crosses slices, and the gather back is one all-gather over those ranks). DTensor nests splits of one dimension
    left to right over the mesh, so a split on a mesh axis left of the slices' axes is a ``_StridedShard`` (torch's
    placement for FSDP's split inside tensor parallelism's); otherwise the split would cut across the slices,
    gathering the whole sequence on the way in and twice on the way out. None: the module's split does not cover
    the slices' axes."""
    if not isinstance(x, DTensor):
        return placements
    sliced = [m for m, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim == 1]
    if not sliced:
        return placements
    if not all(isinstance(placements[m], Shard) and placements[m].dim == 1 for m in sliced):
        return None  # (the split would cut across the slices: the caller says so in one line)
    mesh, out = x.device_mesh, list(placements)
    for m, p in enumerate(placements):
        right = [c for c in sliced if c > m]
        if m not in sliced and isinstance(p, Shard) and p.dim == 1 and right:
            out[m] = _StridedShard(1, split_factor=math.prod(mesh.size(c) for c in right))
    return tuple(out)


def enter(rt, module: torch.nn.Module, args: tuple, follow: bool = False) -> tuple[tuple, tuple, tuple]:
    """The module's arguments as this rank's slices; returns (local args, (placements, input rank, the whole
    sequence's length when following a context-parallel split), gradient placements of its whole parameters). ``follow``: the layout of the first sequence-split input (context
    parallelism), not the module's own split."""
    flat = [t for t in tree_flatten((args,))[0] if isinstance(t, torch.Tensor)]
    if not flat:
        return args, (), P.replicate_placements()
    if follow:
        if mixes_tokens(module):
            name = rt.names.get(id(module), type(module).__name__)
            raise StrategyError(f"context parallelism: module '{name}' ({type(module).__name__}) combines positions "
                                "along the sequence, which each rank holds only a slice of: attention runs split "
                                "(F.scaled_dot_product_attention), this module cannot -- train it without a "
                                "sequence split")
        x = next(t for t in flat if follows((t,)))
        # the context-parallel slices; a sequence-parallel split inside them (a norm's before it) gathered
        placements = tuple(Replicate() if isinstance(p, (Partial, _StridedShard)) else p for p in x.placements)
    else:
        x = flat[0]
        placements = _within_slices(x, input_layout(rt, module, x).placements())
        if placements is None:
            name = rt.names.get(id(module), type(module).__name__)
            strategy = strategy_of(module, x.dim(), rt.device_num)
            raise StrategyError(f"module '{name}' ({type(module).__name__}) split {strategy} beside context "
                                "parallelism's split of the sequence: its own split must split each rank's slice "
                                "again (the sequence over cp x tp ranks: (dp, cp * tp, 1)), or leave the module "
                                "unsplit to run on the slices")
    mesh = world_mesh()

    def local(t):
        if not isinstance(t, torch.Tensor):
            return t
        if tuple(t.shape) == tuple(x.shape):
            dt = t if isinstance(t, DTensor) else P.to_dtensor_replicated(t)
            if tuple(dt.placements) != placements:
                dt = dt.redistribute(mesh, placements)
            return dt.to_local()
        return t.full_tensor() if isinstance(t, DTensor) else t  # a mask or table beside it: whole

    grad = tuple(Partial() if P.splits(p) else Replicate() for p in placements)
    # under context parallelism an output as long as the whole sequence was made from what every rank holds
    # whole (a rotary table from the positions, the activations given only for their dtype): replicated
    whole_length = x.shape[1] if follow else None
    return tree_map(local, args), (placements, x.dim(), whole_length), grad


def leave(rt, module: torch.nn.Module, output, layout: tuple):
    """The module's outputs back as DTensors laid out as its input was."""
    if not layout:
        return output
    placements, ndim, whole_length = layout

    def wrap(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            if whole_length is not None and t.dim() >= 2 and t.shape[1] == whole_length:
                return P.to_dtensor_replicated(t)
            follow = whole_length is not None  # context parallelism: any token-wise output keeps the split
            if t.dim() != ndim and not (follow and t.dim() >= 2):
                name = rt.names.get(id(module), type(module).__name__)
                if follow:
                    raise StrategyError(f"module '{name}' ({type(module).__name__}) ran on its slice of the sequence "
                                        f"(context parallelism) and returned a {t.dim()}-dimensional tensor: a "
                                        "module that reduces over tokens (a loss module) sees only its slice -- "
                                        "compute the loss with torch's functions on the network's outputs")
                raise StrategyError(f"module '{name}' ({type(module).__name__}) split on the sequence returned a "
                                    f"{t.dim()}-dimensional tensor: a split module must keep its input's shape "
                                    "(a norm, a dropout); leave this one whole")
            return P.wrap_local(t, placements)
        return t

    return tree_map(wrap, output)


def check_tensor_parallel(rt, root: torch.nn.Module) -> None:
    """Sequence parallelism splits what lies *between* tensor-parallel layers; without any, it is only a slower data
    parallelism over the sequence: one line."""
    from autopar.ops.shard import has_strategies

    split = next((name for name, m in root.named_modules() if is_split(m)), None)
    if split is not None and not has_strategies(root, splits=False):
        raise StrategyError(f"module '{split or type(root).__name__}' is split on the sequence but no layer of the "
                            "network is split by tensor parallelism: sequence parallelism splits the norms between "
                            "column- and row-parallel layers -- shard those too (colwise / rowwise), or train data "
                            "parallel")
