"""Collectives as functions, autograd-aware, with MindSpore's semantics and gradients.

Each returns a new tensor (inputs are never modified), so the same function serves a training script, an
``autopar.ops.AllReduce`` inside a network's forward, and the parallel runtime. Gradients follow MindSpore's bprop
rules, which treat the job's objective as the sum of every rank's loss:

- all_reduce(sum): grad = all_reduce_sum(grad); mean: that / n; max/min: all_reduce_sum(grad) where x == y;
  prod: all_reduce_sum(grad * y) / x
- all_gather (concatenation along dim 0): grad = reduce_scatter_sum(grad), i.e. this rank's slice of the summed grad
- reduce_scatter: grad = all_gather(grad) (masked / scaled for max, min, mean, prod as above)
- broadcast: grad = the sum of all ranks' grads at the source, zero elsewhere
- all_to_all: grad = all_to_all with split and concat dimensions exchanged

A collective that fails or times out (``AUTOPAR_COMM_TIMEOUT``) raises :class:`CommError` naming the operation.
"""
from __future__ import annotations

from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from autopar.comm import management as M
from autopar.errors import CommError


class ReduceOp(str, Enum):
    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"
    PROD = "prod"

    @classmethod
    def parse(cls, op: Any) -> "ReduceOp":
        if isinstance(op, cls):
            return op
        if isinstance(op, dist.ReduceOp.RedOpType) or op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            op = str(op).split(".")[-1]
        text = str(op).lower()
        for member in cls:
            if text in (member.value, member.name.lower()):
                return member
        raise CommError(f"unknown reduce op {op!r}; expected one of sum, mean, max, min, prod")


# torch 2.14 renamed the tensor-in/tensor-out collectives; keep working on older releases too.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_TORCH_OP = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MEAN: dist.ReduceOp.SUM,  # gloo has no AVG: sum, then divide
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.PROD: dist.ReduceOp.PRODUCT,
}


def _call(name: str, group_name: Any, fn, *args, tensor: torch.Tensor | None = None, **kwargs):
    try:
        return fn(*args, **kwargs)
    except CommError:
        raise
    except Exception as exc:  # gloo/NCCL errors (timeouts, lost peers) carry C++ dumps; keep the first line
        text = str(exc).strip().splitlines()
        where = "the world group" if group_name is None else f"group {group_name!r}"
        what = "" if tensor is None else f" of a {str(tensor.dtype).replace('torch.', '')} tensor of shape " \
                                         f"{tuple(tensor.shape)}"
        raise CommError(f"{name}{what} on {where} failed: {text[0] if text else type(exc).__name__}") from None


# dtypes gloo (and partly NCCL) cannot carry. Moving data (gather, broadcast, all-to-all) views them as the signed
# type of the same width -- bit for bit (uint16 widens to int32: gloo has no int16 either); reducing widens them to
# int64. Results come back in the original dtype.
_MOVE_AS = {torch.uint16: torch.int32, torch.uint32: torch.int32, torch.uint64: torch.int64, torch.bool: torch.uint8}
_REDUCE_AS = {torch.uint16: torch.int64, torch.uint32: torch.int64, torch.uint64: torch.int64, torch.bool: torch.uint8}


def _moved(x: torch.Tensor) -> torch.Tensor:
    carrier = _MOVE_AS.get(x.dtype)
    if carrier is None:
        return x
    return x.view(carrier) if carrier.itemsize == x.dtype.itemsize else x.to(carrier)


def _restored(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if out.dtype == dtype:
        return out
    return out.view(dtype) if out.dtype.itemsize == dtype.itemsize else out.to(dtype)


def _size(group) -> int:
    return M.get_group_size(group)


# ---------------------------------------------------------------------------------------------------------------
# raw (non-differentiable) collectives on contiguous tensors
def _raw_all_reduce(x: torch.Tensor, op: ReduceOp, group) -> torch.Tensor:
    pg = M.get_process_group(group)
    dtype = x.dtype
    out = x.detach().to(_REDUCE_AS.get(dtype, dtype), copy=True).contiguous()
    _call("all_reduce", group, dist.all_reduce, out, op=_TORCH_OP[op], group=pg, tensor=x)
    if op is ReduceOp.MEAN:
        out = out / _size(group) if out.is_floating_point() else out // _size(group)
    return out.to(dtype) if dtype is not torch.bool else out != 0


def _raw_all_gather(x: torch.Tensor, group) -> torch.Tensor:
    pg = M.get_process_group(group)
    given, x = x, _moved(x.detach().contiguous())
    n = _size(group)
    out = x.new_empty((x.shape[0] * n, *x.shape[1:]) if x.dim() else (n,))
    _call("all_gather", group, _all_gather_single, out, x.reshape(-1) if x.dim() == 0 else x, group=pg, tensor=given)
    return _restored(out, given.dtype)


def _raw_reduce_scatter(x: torch.Tensor, op: ReduceOp, group) -> torch.Tensor:
    n = _size(group)
    if x.dim() == 0 or x.shape[0] % n:
        raise CommError(f"reduce_scatter: dimension 0 of shape {tuple(x.shape)} is not divisible by the group size {n}")
    pg = M.get_process_group(group)
    given, dtype = x, x.dtype
    x = x.detach().to(_REDUCE_AS.get(dtype, dtype)).contiguous()
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    _call("reduce_scatter", group, _reduce_scatter_single, out, x, op=_TORCH_OP[op], group=pg, tensor=given)
    if op is ReduceOp.MEAN:
        out = out / n if out.is_floating_point() else out // n
    return out.to(dtype) if dtype is not torch.bool else out != 0


def _raw_broadcast(x: torch.Tensor, src: int, group) -> torch.Tensor:
    pg = M.get_process_group(group)
    out = _moved(x.detach().clone().contiguous())
    _call("broadcast", group, dist.broadcast, out, group=pg, group_src=src, tensor=x)
    return _restored(out, x.dtype)


def _raw_all_to_all(x: torch.Tensor, split_dim: int, concat_dim: int, group) -> torch.Tensor:
    n = _size(group)
    if x.shape[split_dim] % n:
        raise CommError(
            f"all_to_all: dimension {split_dim} of shape {tuple(x.shape)} is not divisible by the group size {n}"
        )
    pg = M.get_process_group(group)
    # Put the split dimension first so each rank's chunk is contiguous, exchange, then concatenate the chunks.
    send = _moved(torch.stack(x.detach().chunk(n, dim=split_dim)).contiguous())
    recv = torch.empty_like(send)
    _call("all_to_all", group, dist.all_to_all_single, recv, send, group=pg, tensor=x)
    return torch.cat(list(_restored(recv, x.dtype).unbind(0)), dim=concat_dim)


# ---------------------------------------------------------------------------------------------------------------
# autograd wrappers
def _remember_reduction(ctx, x, y, op, group) -> None:
    ctx.op, ctx.group = op, group
    if op in (ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PROD):
        ctx.save_for_backward(x, y)


def _reduction_backward(ctx, g, spread, whole):
    """Gradient of ``y = reduce_op(x over the ranks)`` (all-reduce, or reduce-scatter when ``y`` is a slice).

    ``spread(t)`` brings a result-shaped gradient back to every rank's input shape (all-reduce SUM, or all-gather);
    ``whole(y)`` is the full reduced value (``y`` itself, or its all-gather). SUM/MEAN pass the gradient through,
    MAX/MIN route it to the inputs that won, PROD scales it by the product of the others (``y / x``)."""
    op, group = ctx.op, ctx.group
    if op is ReduceOp.PROD:
        x, y = ctx.saved_tensors
        return spread(g * y) / x, None, None
    dx = spread(g)
    if op is ReduceOp.MEAN:
        dx = dx / _size(group)
    elif op in (ReduceOp.MAX, ReduceOp.MIN):
        x, y = ctx.saved_tensors
        dx = dx * (x == whole(y)).to(dx.dtype)
    return dx, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, group):
        y = _raw_all_reduce(x, op, group)
        _remember_reduction(ctx, x, y, op, group)
        return y

    @staticmethod
    def backward(ctx, g):
        return _reduction_backward(ctx, g, lambda t: _raw_all_reduce(t, ReduceOp.SUM, ctx.group), lambda y: y)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _raw_all_gather(x, group)

    @staticmethod
    def backward(ctx, g):
        return _raw_reduce_scatter(g, ReduceOp.SUM, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, group):
        y = _raw_reduce_scatter(x, op, group)
        _remember_reduction(ctx, x, y, op, group)
        return y

    @staticmethod
    def backward(ctx, g):
        gather = lambda t: _raw_all_gather(t, ctx.group)  # noqa: E731
        return _reduction_backward(ctx, g, gather, gather)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, group):
        ctx.src, ctx.group = src, group
        return _raw_broadcast(x, src, group)

    @staticmethod
    def backward(ctx, g):
        total = _raw_all_reduce(g, ReduceOp.SUM, ctx.group)
        if M.get_rank(ctx.group) != ctx.src:
            total = torch.zeros_like(total)
        return total, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, concat_dim, group):
        ctx.dims, ctx.group = (split_dim, concat_dim), group
        return _raw_all_to_all(x, split_dim, concat_dim, group)

    @staticmethod
    def backward(ctx, g):
        split_dim, concat_dim = ctx.dims
        return _raw_all_to_all(g, concat_dim, split_dim, ctx.group), None, None, None


# ---------------------------------------------------------------------------------------------------------------
# public functions
def all_reduce(x: torch.Tensor, op: Any = ReduceOp.SUM, group=None) -> torch.Tensor:
    """Reduce ``x`` over the group (sum, mean, max, min, prod); every rank gets the result."""
    return _AllReduce.apply(x, ReduceOp.parse(op), group)


def all_gather(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dimension 0, in rank order."""
    return _AllGather.apply(x, group)


def reduce_scatter(x: torch.Tensor, op: Any = ReduceOp.SUM, group=None) -> torch.Tensor:
    """Reduce ``x`` over the group and give rank r the r-th slice along dimension 0."""
    return _ReduceScatter.apply(x, ReduceOp.parse(op), group)


def broadcast(x: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Every rank gets rank ``src``'s ``x`` (``src`` is a rank of ``group``)."""
    n = _size(group)
    if not 0 <= src < n:
        raise CommError(f"broadcast: source rank {src} is outside the group of size {n}")
    return _Broadcast.apply(x, src, group)


def all_to_all(x: torch.Tensor, split_dim: int = 0, concat_dim: int = 0, group=None) -> torch.Tensor:
    """Split ``x`` along ``split_dim`` into one chunk per rank, exchange, concatenate along ``concat_dim``."""
    split_dim %= max(x.dim(), 1)
    concat_dim %= max(x.dim(), 1)
    return _AllToAll.apply(x, split_dim, concat_dim, group)


def barrier(group=None) -> None:
    pg = M.get_process_group(group)
    _call("barrier", group, dist.barrier, group=pg)
