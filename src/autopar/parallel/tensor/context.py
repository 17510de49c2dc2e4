"""Context parallelism: attention over a sequence split across ranks.

A job that splits its inputs' sequence (``dataset_strategy=((dp, cp), (dp, cp))``: dimension 1 over cp ranks) runs
every token-wise module on its slice of the sequence -- embeddings, norms, projections, the MLP, the loss's logits --
so activations per rank fall by cp. Only attention needs the other ranks' tokens: a query attends to every earlier
key. Here each rank gathers the keys and values of its context-parallel group (an all-gather, whose backward
reduce-scatters their gradients) and attends with its own queries, under the causal mask at their global positions
-- the all-gather form Llama 3 trained with (Dubey et al. 2024, section 3.3.2), exact: every query's softmax runs over
the same keys as in one process. Or (``context_parallel_algo="ulysses"``) DeepSpeed-Ulysses: an all-to-all moves
query, keys and values onto a split of the heads, attention runs whole over the sequence, and the output moves back. torch's own ``context_parallel`` has no CPU kernel rule (its ring dispatches the
CUDA attention kernels), so this is built on ``F.scaled_dot_product_attention`` of the local tensors.

Active through :mod:`.sequence_attention` (a torch function mode) while a layout runtime whose inputs split the
sequence runs a forward pass.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._pytree import tree_flatten

from autopar.errors import StrategyError

# (and the aten operator a traced graph calls: a pipeline stage's piece)
_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
         torch.ops.aten.scaled_dot_product_attention.default}


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: a local tensor's gradient is taken to have the
    strides its DTensor had, and the attention kernel's gradients come in its own memory order."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _refuse_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise StrategyError("context parallelism: attention dropout differs from one process's draws; train with "
                            "dropout_p=0 in attention")


def _group_size(mesh, axes: list[int]) -> int:
    return math.prod(mesh.size(m) for m in axes)


def _sequence_axes(t: DTensor) -> list[int]:
    seq = t.dim() - 2
    return [m for m, p in enumerate(t.placements) if isinstance(p, Shard) and p.dim == seq]


def _gathered(t: DTensor, axes: list[int], seq: int) -> torch.Tensor:
    """``t`` whole along the sequence on ``axes`` (local), its gradient a partial sum there."""
    target = [Replicate() if m in axes else p for m, p in enumerate(t.placements)]
    if any(isinstance(p, Shard) and p.dim == seq for m, p in enumerate(t.placements) if m not in axes):
        raise StrategyError("context parallelism: keys split on the sequence over other ranks than the queries")
    whole = t.redistribute(t.device_mesh, target)
    grad = [Partial() if m in axes else p for m, p in enumerate(target)]
    return _ContiguousGrad.apply(whole.to_local(grad_placements=grad))


def attention(query: DTensor, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
              scale=None, enable_gqa: bool = False) -> DTensor:
    """``F.scaled_dot_product_attention`` of a query split on its sequence: the keys and values gathered, the
    causal mask (and a given mask's rows) at the local queries' global positions."""
    seq = query.dim() - 2
    axes = _sequence_axes(query)
    mesh = query.device_mesh
    key = key if isinstance(key, DTensor) else DTensor.from_local(key, mesh, [Replicate()] * mesh.ndim, run_check=False)
    value = value if isinstance(value, DTensor) else DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim,
                                                                        run_check=False)
    # contiguous first: the gradients the kernel returns are contiguous, and a local tensor's gradient is taken to
    # have the strides its DTensor had (a head-split view's transposed strides would make the next view fail)
    k, v = _gathered(key.contiguous(), axes, seq), _gathered(value.contiguous(), axes, seq)
    q = _ContiguousGrad.apply(query.contiguous().to_local())
    _, offset = compute_local_shape_and_global_offset(query.shape, mesh, query.placements)
    start, rows, keys = offset[seq], q.shape[-2], k.shape[-2]
    _refuse_dropout(dropout_p)
    if is_causal and attn_mask is None and _blockwise(q, k, v, start, enable_gqa):
        out = _CausalBlocks.apply(q, k, v, start, scale).contiguous()
        shape = (*query.shape[:-1], value.shape[-1])
        return DTensor.from_local(out, mesh, query.placements, run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())
    mask = None
    if is_causal:
        positions = torch.arange(start, start + rows, device=q.device)
        mask = torch.arange(keys, device=q.device) <= positions[:, None]
    if attn_mask is not None:
        # this rank's batch and heads of the mask (whole on the sequence axes), then its queries' rows
        given = _local_mask(attn_mask, query, [Replicate() if m in axes else p for m, p in enumerate(query.placements)])
        if given.dim() >= 2 and given.shape[-2] != 1:
            given = given.narrow(-2, start, rows)
        if given.dtype == torch.bool:
            mask = given if mask is None else mask & given
        else:
            mask = given if mask is None else given.masked_fill(~mask, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa).contiguous()
    shape = (*query.shape[:-1], value.shape[-1])
    return DTensor.from_local(out, mesh, query.placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _blockwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, enable_gqa: bool = False) -> bool:
    """Can causal attention of this rank's queries run as blocks (:class:`_CausalBlocks`)? Real CPU tensors of one
    floating dtype (the CPU flash kernel's), as many key as query heads (or, under ``enable_gqa``, key heads that
    divide them), this rank's keys where its queries are."""
    return (q.device.type == "cpu" and not is_fake(q) and q.dtype in (torch.float32, torch.float64, torch.bfloat16,
                                                                    torch.float16)
            and q.dtype == k.dtype == v.dtype and q.dim() == 4 and k.shape[-3] == v.shape[-3]
            and heads_fit(q.shape[-3], k.shape[-3], enable_gqa)
            and start + q.shape[-2] <= k.shape[-2])


def heads_fit(query_heads: int, key_heads: int, enable_gqa: bool) -> bool:
    """As many key as query heads, or under grouped-query attention (``enable_gqa``) key heads that divide them: what
    the blockwise kernels take (:func:`repeated` makes the rest)."""
    return key_heads == query_heads or (enable_gqa and query_heads % key_heads == 0)


def repeated(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention's key-value heads repeated to the query heads (each serving consecutive ones), for
    the CPU flash kernel, which takes as many of each."""
    group = q.shape[-3] // kv.shape[-3]
    return kv if group == 1 else kv.repeat_interleave(group, dim=-3)


def summed(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of :func:`repeated`: each key-value head's, summed over the query heads it served."""
    return grad if grad.shape[-3] == heads else grad.unflatten(-3, (heads, -1)).sum(-3)


class _CausalBlocks(torch.autograd.Function):
    """Causal attention of the queries at ``[start, start + c)`` over the gathered keys, without a mask: the keys
    before ``start`` are all visible (one unmasked block), the keys at the queries' own positions are the causal
    diagonal, the keys after are never read. Each block runs the CPU flash kernel, which returns its log-sum-exp;
    the two blocks' outputs merge by their log-sum-exps (the blockwise softmax of FlashAttention and ring attention),
    and each block's gradient is the flash kernel's backward given the merged output and log-sum-exp -- the
    softmax over every key, as one process computes it.

    Why: the masked call this replaces builds a ``c x S`` mask and runs the slower masked kernel (a Llama-style
    block at 2,048 tokens on 2 ranks: 0.53 s a step against data parallel's 0.31 s), and it computes the masked-out
    half of the diagonal's neighbours too."""

    @staticmethod
    def forward(ctx, q, k, v, start: int, scale):
        c, kept = q.shape[-2], (k, v)  # (grouped-query keys and values kept as they came: repeated per block)
        k, v = repeated(k, q), repeated(v, q)
        diag = (k[..., start:start + c, :], v[..., start:start + c, :])
        out, lse = _FLASH(q, *diag, 0.0, True, scale=scale)
        if start:
            before, lse0 = _FLASH(q, k[..., :start, :], v[..., :start, :], 0.0, False, scale=scale)
            merged = torch.logaddexp(lse, lse0)
            out = out * torch.exp(lse - merged).unsqueeze(-1) + before * torch.exp(lse0 - merged).unsqueeze(-1)
            out, lse = out.to(q.dtype), merged
        ctx.save_for_backward(q, *kept, out, lse)
        ctx.start, ctx.scale = start, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        heads = k.shape[-3]
        k, v = repeated(k, q), repeated(v, q)
        start, scale, c = ctx.start, ctx.scale, q.shape[-2]
        grad = grad.contiguous()
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dq, dk_diag, dv_diag = _FLASH_BACKWARD(grad, q, k[..., start:start + c, :].contiguous(),
                                               v[..., start:start + c, :].contiguous(), out, lse, 0.0, True,
                                               scale=scale)
        dk[..., start:start + c, :], dv[..., start:start + c, :] = dk_diag, dv_diag
        if start:
            dq0, dk0, dv0 = _FLASH_BACKWARD(grad, q, k[..., :start, :].contiguous(), v[..., :start, :].contiguous(),
                                            out, lse, 0.0, False, scale=scale)
            dq = dq + dq0
            dk[..., :start, :], dv[..., :start, :] = dk0, dv0
        return dq, summed(dk, heads), summed(dv, heads), None, None


def _local_mask(mask, query: DTensor, placements: list) -> torch.Tensor:
    """``mask`` (a DTensor or a tensor made whole inside the network) laid out as ``placements`` say for the query,
    on the dimensions it has (a dimension it broadcasts over stays whole), as this rank's local tensor."""
    mesh = query.device_mesh
    if not isinstance(mask, DTensor):
        mask = DTensor.from_local(mask, mesh, [Replicate()] * mesh.ndim, run_check=False)
    offset = query.dim() - mask.dim()  # a mask of fewer dimensions aligns on the right
    target = []
    for p in placements:
        d = p.dim - offset if isinstance(p, Shard) else -1
        target.append(Shard(d) if isinstance(p, Shard) and d >= 0 and mask.shape[d] > 1 else Replicate())
    if tuple(mask.placements) != tuple(target):
        mask = mask.redistribute(mesh, target)
    return mask.to_local()


_RESHAPES = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten,
             # (the aten operators a traced graph calls: a pipeline stage's piece)
             torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.flatten.using_ints}


def _batch_first(func, t: DTensor, args: tuple, kwargs: dict) -> DTensor:
    """Batch and sequence flattened into one dimension (``logits.view(-1, vocab)`` before the loss) while the
    sequence is split: DTensor records a strided split, which over two mesh axes it cannot take back in the backward
    ("Cannot unflatten tensor with _StridedShard placement"), and which the loss then gathers whole (under the dry
    run's fake tensors, it cannot work out its offsets at all). The tokens are moved onto a batch split first (an
    all-to-all, lighter than the gather; gathered where the batch does not divide), which flattens cleanly."""
    axes = [m for m, p in enumerate(t.placements) if isinstance(p, Shard) and p.dim == 1]
    if t.dim() < 2 or t.shape[0] == 1 or not axes:
        return t
    merged = func(torch.empty(t.shape, device="meta"), *args[1:], **kwargs)
    if merged.dim() == 0 or merged.shape[0] != t.shape[0] * t.shape[1]:
        return t
    parts = _group_size(t.device_mesh, axes)
    moved = Shard(0) if t.shape[0] % parts == 0 else Replicate()
    return t.redistribute(t.device_mesh, [moved if m in axes else p for m, p in enumerate(t.placements)])


def _beside_empty(tensors) -> DTensor | None:
    """The one tensor split on its sequence that a ``torch.cat`` joins to legacy empty ones (shape ``(0,)``, which
    cat skips), or None. A key-value cache's first update (Hugging Face's ``DynamicCache`` starts from
    ``torch.tensor([])``) is such a cat, which DTensor would run by gathering the keys whole on every rank: a full
    sequence's keys kept per layer, and none split for a ring or Ulysses to pass round. Its result is that tensor."""
    if not isinstance(tensors, (list, tuple)):
        return None
    kept = [t for t in tensors if not (isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == 0)]
    if len(kept) == 1 and len(tensors) > 1 and isinstance(kept[0], DTensor) and _sequence_axes(kept[0]) and \
            all(torch.promote_types(t.dtype, kept[0].dtype) == kept[0].dtype for t in tensors):
        return kept[0]
    return None


def check_equal_slices(args, kwargs) -> None:
    """Every rank of a context-parallel group loads an equal slice of one sequence; a sequence the group does not
    divide gives slices of different lengths, which no layout describes. Checked at every call (one all-gather of a
    few integers, on the inputs' device): one line, not a wrong result or a hang."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if not tensors or not dist.is_initialized() or any(is_fake(t) for t in tensors):
        return  # (a dry run simulates one rank: the others' slices are not loaded)
    shapes = [tuple(t.shape) for t in tensors]
    # every call, on every rank: a check some ranks skip would leave the others waiting in the collective
    lengths = torch.tensor([s[1] if len(s) > 1 else -1 for s in shapes], dtype=torch.int64, device=tensors[0].device)
    gathered = [torch.empty_like(lengths) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, lengths)
    for k in range(len(shapes)):
        seen = sorted({int(g[k]) for g in gathered if len(g) > k})
        if len(seen) > 1:
            raise StrategyError(f"context parallelism: the ranks loaded slices of {' and '.join(map(str, seen))} "
                                f"tokens of input {k}: each rank holds an equal slice of the sequence -- make the "
                                f"sequence a multiple of the context-parallel degree (pad it)")


def ulysses(query: DTensor, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
            scale=None, enable_gqa: bool = False) -> DTensor:
    """DeepSpeed-Ulysses (Jacobs et al. 2023): query, keys and values moved from the sequence split onto a split of
    the heads (an all-to-all each), attention whole over the sequence on each rank's heads, the output moved back.
    The heads -- the key-value heads too -- must divide the context-parallel group."""
    mesh, heads = query.device_mesh, query.dim() - 3
    axes = _sequence_axes(query)
    parts = _group_size(mesh, axes)
    if not isinstance(key, DTensor) or not isinstance(value, DTensor):
        raise StrategyError("context_parallel_algo='ulysses' needs the keys and values split on the sequence as the "
                            "query is (made from the network's inputs); use context_parallel_algo='all_gather'")
    q_heads, kv_heads = query.to_local().shape[heads], key.to_local().shape[heads]  # after any tensor-parallel split
    if q_heads % parts or kv_heads % parts:
        raise StrategyError(f"context_parallel_algo='ulysses' splits the heads over the {parts} ranks of the "
                            f"sequence, but each rank's attention has {q_heads} query and {kv_heads} key-value heads: "
                            "give a head count they divide, or context_parallel_algo='all_gather'")
    _refuse_dropout(dropout_p)
    group = _group_of(mesh, axes)
    rank = dist.get_rank(group)
    q, k, v = (_SequenceToHeads.apply(t.contiguous().to_local(), group, parts, rank, heads)
               for t in (query, key, value))
    if attn_mask is not None:  # this rank's batch and (after the exchange) heads, the whole sequence
        attn_mask = _local_mask(attn_mask, query, [Shard(heads) if m in axes else p
                                                   for m, p in enumerate(query.placements)])
    local = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                           enable_gqa=enable_gqa)
    local = _SequenceToHeads.apply(local.contiguous(), group, parts, rank, heads, True)
    shape = (*query.shape[:-1], value.shape[-1])
    return DTensor.from_local(local, mesh, query.placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _group_of(mesh, axes: list[int]):
    """The process group of the mesh axes that split the sequence (flattened in their order: the order of the
    sequence's slices)."""
    if len(axes) == 1:
        return mesh.get_group(axes[0])
    names = tuple(mesh.mesh_dim_names[m] for m in axes)
    return mesh[names]._flatten().get_group()


def _exchange(t: torch.Tensor, group, parts: int, rank: int, gather_dim: int, split_dim: int) -> torch.Tensor:
    """The all-to-all that moves ``t`` from a split of ``gather_dim`` to a split of ``split_dim`` (contiguous):
    NCCL's all_to_all; gloo has none, so there it is an all-gather and this rank's chunk (what torch's DTensor does
    on gloo too)."""
    if dist.get_backend(group) == "gloo":
        pieces = [torch.empty_like(t) for _ in range(parts)]
        dist.all_gather(pieces, t.contiguous(), group=group)
        return torch.cat(pieces, dim=gather_dim).chunk(parts, dim=split_dim)[rank].contiguous()
    send = [c.contiguous() for c in t.chunk(parts, dim=split_dim)]
    recv = [torch.empty_like(send[0]) for _ in range(parts)]
    dist.all_to_all(recv, send, group=group)
    return torch.cat(recv, dim=gather_dim).contiguous()


class _SequenceToHeads(torch.autograd.Function):
    """Ulysses' all-to-all: from a split of the sequence to a split of the heads (``back``: the other way); the
    backward is the opposite move."""

    @staticmethod
    def forward(ctx, t, group, parts: int, rank: int, heads: int, back: bool = False):
        ctx.args = (group, parts, rank, heads, back)
        seq = heads + 1
        return _exchange(t, group, parts, rank, heads if back else seq, seq if back else heads)

    @staticmethod
    def backward(ctx, grad):
        group, parts, rank, heads, back = ctx.args
        seq = heads + 1
        return _exchange(grad, group, parts, rank, seq if back else heads, heads if back else seq), None, None, \
            None, None, None
