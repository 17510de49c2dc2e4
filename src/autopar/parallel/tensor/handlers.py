"""Operators whose DTensor handling differs from one process, and the path they run instead.

**Narrowing casts of partial sums: reduced first, then cast -- as one process rounds.** A contracted dimension split
over ranks leaves each rank a partial sum (DTensor's ``Partial``), resolved lazily by its next consumer. DTensor lets
a float-to-float cast pass a partial sum through unreduced (its rule for ``aten._to_copy``), so ``logits.float()`` on
a float64 partial -- what Hugging Face's causal-LM loss does to every model's logits -- rounds each rank's part to
float32 and adds the rounded parts, where one process rounds the whole sum once: ~1e-6 apart from one process after
AdamW in float64 (a Llama whose ``lm_head`` is split on its input features), and under bf16 partial sums rounded to 8
bits of mantissa before they are added. A cast to a narrower type (fewer bits, another float format, an integer)
here first reduces the partial placements -- an all-reduce of the wider type -- and casts the whole value; every
other cast runs as DTensor runs it.

:func:`dispatch` is DTensor's own path for one call, for handlers that change the inputs first (this cast, and
attention's in :mod:`autopar.parallel.tensor.attention`), and it also moves keyword tensors, which DTensor's
dispatcher leaves where they are ("very rare", its comment says: attention's ``attn_mask`` is one). Handlers go in
DTensor's table of operator handlers (the mechanism torch's own ``loss_parallel`` uses), once, when the first layout
runtime is made (not at import).

**``F.mse_loss``'s gradient** over a split batch: DTensor's rule scales it by the number of ranks; it is computed here
from DTensor's element-wise operators instead (:func:`_mse_loss_backward`).

**Tokens flattened from a sequence split over several mesh axes, unflattened again** (:func:`_view`): a norm's
sequence split on a world mesh of two axes (4 ranks: 2 x 2) is ``Shard(1)`` on both; flattening the batch and the
sequence (``h.reshape(-1, d)``, as Mixtral's MoE block and a mixture's experts do) gives torch's ``_StridedShard`` on
both axes, and torch's view rule cannot undo it ("Cannot unflatten tensor with _StridedShard placement"). The
inverse of that flattening is the local tensor's own view, the split back on the unflattened dimension. Installed
only where the world mesh has several axes.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_unflatten

from autopar.parallel.tensor.placements import row_major, strided_axes

_registered = False


def narrows(source: torch.dtype, target: torch.dtype | None) -> bool:
    """Whether a cast from ``source`` to ``target`` can lose what a sum of ``source`` values holds."""
    if target is None or target == source or not source.is_floating_point:
        return False
    if not target.is_floating_point:
        return True
    wide, narrow = torch.finfo(source), torch.finfo(target)
    return narrow.bits < wide.bits or (narrow.bits == wide.bits and narrow.eps != wide.eps)  # fp16 <-> bf16


def dispatch(op_call, args: tuple, kwargs: dict, keyword_placements=None):
    """DTensor's own path for one operator call: propagate the placements, move the inputs, run on the local
    tensors, wrap the result (what its dispatcher does where no handler is registered). ``keyword_placements(args
    specs)`` -> {keyword: placements} names where keyword tensors must be, given the positional inputs' specs."""
    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(info)
    sharding = info.output_sharding
    schema = info.schema
    if sharding.needs_redistribute:
        schema = sharding.redistribute_schema
        dispatcher.redistribute_local_args(info, schema, sharding.use_val_from_redistribute_schema)
    for name, placements in (keyword_placements(schema.args_schema) if keyword_placements else {}).items():
        spec = info.schema.kwargs_schema.get(name)
        if isinstance(spec, DTensorSpec) and tuple(spec.placements) != tuple(placements):
            target = DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)
            info.local_kwargs[name] = redistribute_local_tensor(info.local_kwargs[name], spec, target)
    local_args = tree_unflatten(list(info.local_args), info.args_tree_spec) if info.args_tree_spec else info.local_args
    return dispatcher.wrap(op_call(*local_args, **info.local_kwargs), sharding.output_spec)


def _to_copy(op_call, args: tuple, kwargs: dict):
    source = args[0]
    if (isinstance(source, DTensor) and narrows(source.dtype, kwargs.get("dtype"))
            and any(p.is_partial() for p in source.placements)):
        whole = [Replicate() if p.is_partial() else p for p in source.placements]
        args = (source.redistribute(source.device_mesh, whole), *args[1:])
    return dispatch(op_call, args, kwargs)


def _mse_loss_backward(op_call, args: tuple, kwargs: dict):
    """``F.mse_loss``'s gradient, ``2 (input - target) grad / N``, in DTensor's own element-wise operators. DTensor's
    rule for ``aten.mse_loss_backward`` gives a mean taken over a split batch (the loss ``Partial(avg)``) n times the
    gradient of one process -- measured 2x on 2 ranks, where its rule for ``mean`` is exact."""
    grad, source, target = args[:3]
    reduction = args[3] if len(args) > 3 else kwargs.get("reduction", 1)
    if not isinstance(source, DTensor):
        return dispatch(op_call, args, kwargs)
    diff = source - target
    scale = 2.0 / source.numel() if reduction == 1 else 2.0  # 1: mean, 2: sum, 0: none
    return diff * grad * scale


def _unflattened(source: DTensor, shape) -> DTensor | None:
    """``source.view(shape)`` where ``source``'s dimension d is the flattening of (``sf``, n) that torch's view rule
    placed ``_StridedShard(d, sf)`` on several mesh axes (the nested split of n those axes held) and ``shape`` splits
    it back into (sf, n): each rank's local tensor viewed alike, the axes' split on n again. None otherwise."""
    strided = strided_axes(source.placements)
    if len(strided) < 2 or len({(p.dim, p.split_factor) for p in strided}) != 1:
        return None
    dim, factor = strided[0].dim, strided[0].split_factor
    shape = list(shape)
    if -1 in shape:  # (the one inferred size)
        known = math.prod(n for n in shape if n != -1)
        shape[shape.index(-1)] = source.numel() // known if known else 0
    whole = list(source.shape)
    if (len(shape) != len(whole) + 1 or shape[:dim] != whole[:dim] or shape[dim + 2:] != whole[dim + 1:]
            or shape[dim] != factor or shape[dim] * shape[dim + 1] != whole[dim]):
        return None
    if any(isinstance(p, Shard) and not isinstance(p, _StridedShard) and p.dim == dim for p in source.placements):
        return None
    placements = [Shard(dim + 1) if isinstance(p, _StridedShard) else Shard(p.dim + 1)
                  if isinstance(p, Shard) and p.dim > dim else p for p in source.placements]
    local = source.to_local()
    view = local.view(*local.shape[:dim], factor, local.shape[dim] // factor, *local.shape[dim + 1:])
    return DTensor.from_local(view, source.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=row_major(shape))


def _view(op_call, args: tuple, kwargs: dict):
    source = args[0]
    if isinstance(source, DTensor) and len(args) > 1:
        out = _unflattened(source, args[1])
        if out is not None:
            return out
    # every other view as DTensor runs it, its own way (its refusals keep the notes :mod:`.explain` reads)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers.pop(op_call, None)
    try:
        return op_call(*args, **kwargs)
    finally:
        handlers[op_call] = _view


def install(op, handler) -> None:
    """Run ``handler(op_call, args, kwargs)`` instead of DTensor's path for ``op`` (torch's private table: the one
    place autopar writes it)."""
    DTensor._op_dispatcher._custom_op_handlers[op] = handler


def register_cast_handler() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    install(torch.ops.aten._to_copy.default, _to_copy)
    install(torch.ops.aten.mse_loss_backward.default, _mse_loss_backward)
    from autopar.comm.topology import mesh_shape

    if len(mesh_shape()) > 1:  # (on a world mesh of one axis no split is strided over two: no view needs it, and
        # every view would pay its second dispatch -- bench/dtensor_view.py)
        install(torch.ops.aten.view.default, _view)
        install(torch.ops.aten._unsafe_view.default, _view)
