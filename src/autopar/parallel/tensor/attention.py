"""Attention under layouts: ``F.scaled_dot_product_attention`` on DTensors.

Attention is independent per sample and per head, so with the batch or the heads split it is a *local* operator on
each rank's shards -- Megatron's tensor-parallel attention. DTensor knows that for the CUDA kernels; for the CPU's
flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``, forward and backward) torch registers no sharding
strategy and every call stops with "does not have a sharding strategy registered". The rules below say it: all
inputs replicated, or all split on the batch, or all split on the heads -- the output (and the log-sum-exp the
backward needs) split the same way. Registered once, when the first layout runtime is made (not at import).

Two more things the kernel needs that DTensor's dispatch does not give it, done by a handler around both kernels:

- **The mask where the query is.** ``attn_mask`` is a keyword argument, and DTensor moves only positional inputs:
  a padding mask made whole inside the network (BERT's) stayed whole where the rule split the batch -- "shape
  '[1, 1, 8, 8]' is invalid for input of size 256". The handler moves it to the query's placements (replicated on
  a dimension it broadcasts over).
- **Contiguous inputs.** The kernel returns its output (and its gradients) in its inputs' memory order. DTensor works
  the output's global strides out from the inputs as they came, before it moves them to the placements the rule
  asks for -- a move that leaves the local tensors contiguous. A query split on its heads (``q_proj`` split by
  columns: ``view`` then ``transpose``, not contiguous) that attention moves onto the batch split came back claiming
  a transposed layout its local tensor did not have; Hugging Face's ``.contiguous()`` then copied nothing (the
  global strides said it was) and the next ``view`` failed with "view size is not compatible with input tensor's
  size and stride". Contiguous inputs give the same order on both sides.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from autopar.parallel.tensor.handlers import dispatch, install

_registered = False


def mask_placement(attn_mask, dim: int | None):
    """Where the mask goes when the query is split on ``dim`` (None: replicated)."""
    if attn_mask is None:
        return None
    if dim is None or attn_mask.ndim < 4 or attn_mask.shape[dim] == 1:
        return Replicate()  # broadcast over that dimension: every rank needs it whole
    return Shard(dim)


def _handler(query_index: int):
    def run(op_call, args: tuple, kwargs: dict):
        args = tuple(a.contiguous() if isinstance(a, DTensor) else a for a in args)
        mask = kwargs.get("attn_mask")

        def keyword_placements(specs):
            placements = specs[query_index].placements
            return {"attn_mask": [mask_placement(mask, p.dim if p.is_shard() else None) for p in placements]}

        return dispatch(op_call, args, kwargs, keyword_placements if isinstance(mask, torch.Tensor) else None)

    return run


def register_attention_rules() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is None or backward is None:  # a torch without the CPU flash kernel: nothing to teach DTensor
        return

    @register_sharding(forward.default)
    def _forward(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        rules = [([Replicate(), Replicate()],
                  [Replicate(), Replicate(), Replicate(), None, None, mask_placement(attn_mask, None), None])]
        for d in (0, 1):  # batch, heads
            rules.append(([Shard(d), Shard(d)], [Shard(d), Shard(d), Shard(d), None, None, mask_placement(attn_mask, d),
                                                 None]))
        return rules

    @register_sharding(backward.default)
    def _backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None):
        rules = [([Replicate()] * 3, [Replicate()] * 6 + [None, None, mask_placement(attn_mask, None), None])]
        for d in (0, 1):
            rules.append(([Shard(d)] * 3, [Shard(d)] * 6 + [None, None, mask_placement(attn_mask, d), None]))
        return rules

    install(forward.default, _handler(0))
    install(backward.default, _handler(1))
