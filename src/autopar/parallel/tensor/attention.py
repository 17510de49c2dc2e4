"""Attention under layouts: ``F.scaled_dot_product_attention`` on DTensors.

Attention is independent per sample and per head, so with the batch or the heads split it is a *local* operator on
each rank's shards -- Megatron's tensor-parallel attention. DTensor knows that for the CUDA kernels; for the CPU's
flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``, forward and backward) torch registers no sharding
strategy and every call stops with "does not have a sharding strategy registered". The rules below say it: all
inputs replicated, or all split on the batch, or all split on the heads -- the output (and the log-sum-exp the
backward needs) split the same way. Registered once, when the first layout runtime is made (not at import).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

_registered = False


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

    def mask_placement(attn_mask, dim: int):
        if attn_mask is None:
            return None
        if dim is None or attn_mask.ndim < 4 or attn_mask.shape[dim] == 1:
            return Replicate()  # broadcast over that dimension: every rank needs it whole
        return Shard(dim)

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
