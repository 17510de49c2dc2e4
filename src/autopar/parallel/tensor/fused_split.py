"""A column-split fused projection taken apart into its parts, each split by heads (Megatron's tensor-parallel
attention): nanoGPT's and GPT-2's ``q, k, v = self.c_attn(x).split(self.n_embd, dim=2)``.

Split by columns over ``t`` ranks, the fused projection's output gives rank ``r`` the contiguous ``r``-th ``1/t`` of
the 3 x hidden features -- across q, k and v, not a ``1/t`` of each. DTensor meets ``split`` on a split dimension by
gathering the whole output on every rank, so q, k and v arrived whole and attention ran whole on every rank: exact,
but with t times the attention's work and memory. Here ``split`` / ``chunk`` into ``k`` equal parts, each of which the
``t`` ranks divide, is one all-to-all instead: each rank sends every other rank the pieces of its features that
rank's ``1/t`` of each part needs (the part's features ``[i*s + r*s/t, i*s + (r+1)*s/t)``), and each part comes back a
DTensor split on that dimension -- the heads, after the ``view`` that follows. The backward is the all-to-all the
other way (``all_to_all_single_autograd``), so the projection's weight gradient stays a column split.

Megatron lays the fused weight out so that a rank's columns are already its heads' q, k and v (no all-to-all at all);
a user's ``nn.Linear`` keeps q, k and v one after the other, which a column split cannot take apart without moving
them. The all-to-all moves ``(t-1)/t`` of the local output, where the gather moved ``t - 1`` times it.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

_SPLITS = {torch.Tensor.split: "split", torch.split: "split", torch.Tensor.chunk: "chunk", torch.chunk: "chunk"}
_RESHAPES = {torch.Tensor.reshape, torch.reshape}  # (not ``view``: its result must alias its input)
_VIEWS = {torch.Tensor.reshape, torch.reshape, torch.Tensor.view}


class FusedSplit(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _SPLITS.get(func)
        if kind is not None and args and isinstance(args[0], DTensor):
            parts = _by_parts(args[0], kind, args[1] if len(args) > 1 else kwargs.get(
                "split_size_or_sections", kwargs.get("split_size", kwargs.get("chunks"))),
                args[2] if len(args) > 2 else kwargs.get("dim", 0))
            if parts is not None:
                return parts
        if func in _VIEWS and len(args) >= 2 and isinstance(args[0], DTensor) and not kwargs:
            shape = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
            made = _into_parts(args[0], shape) if func in _RESHAPES else None
            if made is not None:
                return made
            if getattr(args[0], "_autopar_part", False) and _unflattens_unevenly(args[0], shape):
                # a part whose heads the ranks do not divide (12 heads over 8): whole, as DTensor had it before
                whole = [Replicate() if _shard_of(p) is not None else p for p in args[0].placements]
                args = (args[0].redistribute(args[0].device_mesh, whole), *args[1:])
        return func(*args, **kwargs)


def _into_parts(x: DTensor, shape) -> DTensor | None:
    """timm's ``qkv(x).reshape(B, N, 3, heads, head_dim)``: the split last dimension unflattened into ``(k, ...)``
    with ``k`` parts -- cut into its parts as :func:`_by_parts` does (each split over the ranks), stacked on a new
    dimension, then reshaped: the split lands on the dimension after ``k`` (the heads), which DTensor's view rule
    carries where the ranks divide it (None: not such a reshape -- DTensor's own path runs)."""
    if not all(isinstance(d, int) for d in shape) or x.dim() == 0 or \
            not any(_shard_of(p) == x.dim() - 1 for p in x.placements):
        return None
    shape = list(shape)
    lead = x.dim() - 1
    if len(shape) < lead + 3 or -1 in shape[lead:] or list(shape[:lead]) != [d if d != -1 else x.shape[i] for i, d
                                                                            in enumerate(shape[:lead])]:
        return None
    k, rest = shape[lead], math.prod(shape[lead + 1:])
    t = _ranks_splitting(x, x.dim() - 1)
    # (k the ranks divide: a heads-first layout, BLOOM's (heads, 3, head_dim) -- DTensor splits it on k without
    # moving anything; the dimension after k not divided: the part's view would fail after the all-to-all)
    if k < 2 or k * rest != x.shape[-1] or k % t == 0 or shape[lead + 1] % t:
        return None
    parts = _by_parts(x, "chunk", k, x.dim() - 1)
    if parts is None:
        return None
    return torch.stack(parts, dim=lead).reshape(list(x.shape[:lead]) + shape[lead:])


def _shard_of(p) -> int | None:
    """The dimension a placement splits evenly and contiguously (a plain ``Shard``; not ``_StridedShard``)."""
    return p.dim if type(p) is Shard else None


def _ranks_splitting(x: DTensor, dim: int) -> int:
    """Over how many ranks ``x``'s dimension ``dim`` is split (its plain ``Shard`` mesh axes together)."""
    return math.prod(x.device_mesh.size(a) for a, p in enumerate(x.placements) if _shard_of(p) == dim)


def _unflattens_unevenly(x: DTensor, shape) -> bool:
    """Does reshaping ``x`` to ``shape`` unflatten a split dimension into a first new dimension the ranks that split
    it do not divide (nanoGPT's ``q.view(B, T, heads, head_dim)`` with heads that do not divide over the ranks)?"""
    if not all(isinstance(d, int) for d in shape) or len(shape) <= x.dim():
        return False
    for dim in {_shard_of(p) for p in x.placements} - {None}:
        t = _ranks_splitting(x, dim)
        if list(shape[:dim]) == list(x.shape[:dim]) and dim < len(shape) and shape[dim] > 0 and shape[dim] % t:
            return True
    return False


def enter() -> FusedSplit:
    mode = FusedSplit()
    mode.__enter__()
    return mode


def _group(x: DTensor, axes: list[int]):
    """(process group, this rank's index in it) of the mesh axes that split the dimension: one axis, or every axis
    of the mesh -- the world, whose ranks ``init_device_mesh`` lays out in order (a dimension split over axes 0 and 1
    is split in the order of their coordinates, rank by rank); None otherwise."""
    mesh = x.device_mesh
    if len(axes) == 1:
        return mesh.get_group(axes[0]), mesh.get_local_rank(axes[0])
    if axes == list(range(mesh.ndim)) and mesh.size() == dist.get_world_size():
        return dist.group.WORLD, dist.get_rank()
    return None


def _sizes(kind: str, how, length: int) -> list[int] | None:
    if kind == "chunk":
        if not isinstance(how, int) or how < 1:
            return None
        size = math.ceil(length / how)
        return [size] * how if size * how == length else None
    if isinstance(how, int):
        return [how] * (length // how) if how > 0 and length % how == 0 else None
    return list(how) if isinstance(how, (list, tuple)) and all(isinstance(s, int) for s in how) else None


def _by_parts(x: DTensor, kind: str, how, dim) -> tuple[DTensor, ...] | None:
    """``x`` cut into equal parts along ``dim``, each split over the ranks that split ``dim`` (None: not such a cut --
    DTensor's own path runs)."""
    if not isinstance(dim, int) or x.dim() == 0:
        return None
    dim %= x.dim()
    axes = [a for a, p in enumerate(x.placements) if _shard_of(p) == dim]
    if not axes or any(p.is_partial() or (p.is_shard() and _shard_of(p) is None) for p in x.placements):
        return None
    located = _group(x, axes)
    length = x.shape[dim]
    sizes = _sizes(kind, how, length)
    t = _ranks_splitting(x, dim)
    if located is None or not sizes or len(sizes) < 2 or len(set(sizes)) > 1 or sizes[0] % t or length % t:
        return None
    group, index = located
    k, block = len(sizes), sizes[0] // t
    # global blocks of ``block`` features: rank q holds blocks [q*k, (q+1)*k); block j belongs to part j // t of rank
    # j % t. Sent grouped by destination; received in increasing j, which is the parts' order.
    mine = range(index * k, (index + 1) * k)
    order = sorted(mine, key=lambda j: (j % t, j))
    rows = x.to_local().movedim(dim, 0)
    send = torch.cat([rows[(j - index * k) * block:(j - index * k + 1) * block] for j in order])
    sent = [block * sum(1 for j in mine if j % t == d) for d in range(t)]
    received = [block * sum(1 for j in range(q * k, (q + 1) * k) if j % t == index) for q in range(t)]
    got = funcol.all_to_all_single_autograd(send.contiguous(), received, sent, group)
    got = funcol.wait_tensor(got) if isinstance(got, funcol.AsyncCollectiveTensor) else got
    shape = list(x.shape)
    shape[dim] = sizes[0]
    stride = torch.empty(shape, device="meta").stride()
    parts = tuple(DTensor.from_local(piece.movedim(0, dim).contiguous(), x.device_mesh, x.placements,
                                     run_check=False, shape=torch.Size(shape), stride=stride)
                  for piece in got.split(block, dim=0))
    for part in parts:
        part._autopar_part = True  # (a view its ranks cannot split gathers it first: _unflattens_unevenly)
    return parts
