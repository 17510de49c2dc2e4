"""Ring attention with causal load balancing (``context_parallel_algo="ring"``, MindFormers' ``"colossalai_cp"``).

The all-gather form (:mod:`.context`) holds every key and value of the sequence on each rank for the backward, and
under a causal mask the last rank's queries attend to every key while the first's attend to their own: the step
waits for the last. The ring (Liu et al. 2023, arXiv 2310.01889; Megatron-LM's context parallelism) keeps one
block of keys and values in hand: each of the cp - 1 hops passes it to the next rank while the block already there
is attended to, the blocks' outputs merged by their log-sum-exps, and the backward passes the keys' and values'
gradients round behind them. Load balancing (Megatron's and torch's, each rank holding two mirrored chunks of the
sequence -- rank r chunks r and 2cp-1-r of 2cp) gives every rank the same causal work.

The layouts keep each rank's contiguous slice (positions, RoPE, the shifted labels and the loss are computed on it
as for the other algorithms), so the balance is made at attention: query, keys and values move from the contiguous
slices to the mirrored chunks (point to point: on two ranks half of each rank's tokens, on more nearly all), and
the output moves back.

The ring itself is torch's (``_templated_ring_attention`` and its backward, the loop ``context_parallel`` runs on
GPUs) with the CPU flash kernel as its block operator (the dry run's fake tensors run it too, so it measures the
ring's memory); on other devices, with a mask, or where the keys are not split as the queries are, the all-gather
form runs instead and says so once. Under grouped-query attention the ring passes the key-value heads as they are
(a query-per-key-value-head group times fewer bytes each hop, as Megatron's) and each block repeats them to the
query heads only for its kernel; their gradients are summed back over the group. Exact: every query's softmax runs over the same keys as in one process,
merged in another order.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.errors import StrategyError, warn_once
from autopar.parallel.tensor import context

try:  # torch >= 2.9 keeps context parallelism in a package; before, in one module
    from torch.distributed.tensor.experimental._context_parallel import _attention as _torch_cp
except ImportError:  # pragma: no cover - older torch
    from torch.distributed.tensor.experimental import _attention as _torch_cp

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_SEQ = 2  # (batch, heads, sequence, head_dim)


def ring(query: DTensor, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
         scale=None, enable_gqa: bool = False) -> DTensor:
    """``F.scaled_dot_product_attention`` of query, keys and values split on their sequence, as a ring."""
    why = _why_not(query, key, value, attn_mask, enable_gqa)
    if why:
        warn_once(f"ring:{why}", f"context_parallel_algo='ring' gathers the keys and values instead (the "
                                 f"all_gather form, exact too) where {why}")
        return context.attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    context._refuse_dropout(dropout_p)
    mesh, axes = query.device_mesh, context._sequence_axes(query)
    group = context._group_of(mesh, axes)
    q, k, v = (context._ContiguousGrad.apply(t.contiguous().to_local()) for t in (query, key, value))
    if is_causal and q.shape[_SEQ] % 2:
        parts = dist.get_world_size(group)
        raise StrategyError(f"context_parallel_algo='ring' balances the causal work by giving each of the {parts} "
                            f"ranks two mirrored chunks of the sequence: make the sequence a multiple of {2 * parts} "
                            f"(pad it)")
    if is_causal:
        q, k, v = (_Balance.apply(t, group, False) for t in (q, k, v))
    out = _Ring.apply(q, k, v, group, is_causal, scale)
    if is_causal:
        out = _Balance.apply(out, group, True)
    shape = (*query.shape[:-1], value.shape[-1])
    return DTensor.from_local(out.contiguous(), mesh, query.placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _why_not(query: DTensor, key, value, attn_mask, enable_gqa: bool = False) -> str | None:
    """Why this call cannot run as a ring (None: it can)."""
    if attn_mask is not None:
        return "attention is given a mask (the ring's blocks are causal or whole)"
    if not isinstance(key, DTensor) or not isinstance(value, DTensor) or \
            context._sequence_axes(key) != context._sequence_axes(query):
        return "the keys and values are not split on the sequence as the queries are"
    q = query.to_local()
    if q.device.type != "cpu":
        return "the tensors are not on the CPU (the ring runs the CPU flash kernel)"
    if q.dim() != 4 or not q.dtype == key.dtype == value.dtype or \
            q.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return "query, keys and values are not 4-dimensional tensors of one floating dtype"
    if query.shape[-2] != key.shape[-2] or key.shape[-3] != value.shape[-3] or \
            not context.heads_fit(query.shape[-3], key.shape[-3], enable_gqa):
        return ("the keys are not as many as the queries, or their heads are not the query heads' (nor, under "
                "enable_gqa, divide them)")
    return None


@contextlib.contextmanager
def _options(balanced: bool, dtype: torch.dtype):
    """torch's ring reads module-wide options: a true ring (one block passed to the next rank at each hop, not one
    all-gather), balanced where the call is causal, and the merge in fp32 only for half-precision blocks (a float64
    block stays float64)."""
    opts = _torch_cp._cp_options
    with _OPTIONS:  # (module-wide: one ring at a time per process)
        saved = (opts.enable_load_balance, opts.rotate_method, opts.convert_to_f32)
        opts.enable_load_balance, opts.rotate_method = balanced, _torch_cp._RotateMethod.ALL_TO_ALL
        opts.convert_to_f32 = dtype in (torch.bfloat16, torch.float16)
        try:
            yield
        finally:
            opts.enable_load_balance, opts.rotate_method, opts.convert_to_f32 = saved


_OPTIONS = threading.Lock()


class _Ring(torch.autograd.Function):
    """torch's ring forward and backward over local blocks, the CPU flash kernel computing each block."""

    @staticmethod
    def forward(ctx, q, k, v, group, is_causal: bool, scale):
        def block(q, k, v, is_causal, **_):
            k, v = context.repeated(k, q), context.repeated(v, q)
            return _FLASH(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, bool(is_causal), scale=scale)

        with _options(is_causal, q.dtype):
            out, lse = _torch_cp._templated_ring_attention(group, _SEQ, block, q, k, v, is_causal=is_causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, is_causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group, is_causal, scale = ctx.args

        def block(query, key, value, out, logsumexp, is_causal, grad_out, **_):
            heads = key.shape[-3]
            key, value = context.repeated(key, query), context.repeated(value, query)
            dq, dk, dv = _FLASH_BACKWARD(grad_out.contiguous(), query.contiguous(), key.contiguous(),
                                         value.contiguous(), out.contiguous(), logsumexp.contiguous(), 0.0,
                                         bool(is_causal), scale=scale)[:3]
            return dq, context.summed(dk, heads), context.summed(dv, heads)

        with _options(is_causal, q.dtype):
            dq, dk, dv = _torch_cp._templated_ring_attention_backward(
                group, _SEQ, block, grad.contiguous(), "grad_out", q, k, v, out, lse, is_causal)[:3]
        return dq, dk, dv, None, None, None


def _moves(parts: int, rank: int, back: bool) -> tuple[list, list]:
    """What this rank sends and receives to move the sequence's 2 x parts chunks from the contiguous slices (rank
    r: chunks 2r, 2r+1) to the mirrored pairs (rank r: chunks r, 2 parts - 1 - r), or back: (peer, my half, tag)
    each -- the tag is the half the chunk fills at the receiver, as two chunks may go to one rank."""
    def contiguous(j):
        return j // 2, j % 2

    def balanced(j):
        return (j, 0) if j < parts else (2 * parts - 1 - j, 1)

    sends, recvs = [], []
    for j in range(2 * parts):
        (src, s_half), (dst, d_half) = (balanced(j), contiguous(j)) if back else (contiguous(j), balanced(j))
        if src == rank:
            sends.append((dst, s_half, d_half))
        if dst == rank:
            recvs.append((src, d_half, d_half))
    return sends, recvs


def _move(t: torch.Tensor, group, back: bool) -> torch.Tensor:
    parts, rank = dist.get_world_size(group), dist.get_rank(group)
    halves = [h.contiguous() for h in t.chunk(2, dim=_SEQ)]
    out = [torch.empty_like(h) for h in halves]
    sends, recvs = _moves(parts, rank, back)
    ops = []
    for peer, half, tag in sends:
        if peer == rank:
            out[tag] = halves[half]
        else:
            ops.append(dist.P2POp(dist.isend, halves[half], dist.get_global_rank(group, peer), group, tag))
    for peer, half, tag in recvs:
        if peer != rank:
            ops.append(dist.P2POp(dist.irecv, out[half], dist.get_global_rank(group, peer), group, tag))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return torch.cat(out, dim=_SEQ)


class _Balance(torch.autograd.Function):
    """The move between contiguous slices and mirrored chunks; its backward is the opposite move."""

    @staticmethod
    def forward(ctx, t, group, back: bool):
        ctx.args = (group, back)
        return _move(t, group, back)

    @staticmethod
    def backward(ctx, grad):
        group, back = ctx.args
        return _move(grad.contiguous(), group, not back), None, None
