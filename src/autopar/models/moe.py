"""A mixture-of-experts feed-forward block in Hugging Face's form: a top-k router and one module of stacked expert
weights (``[experts, ...]``, called ``(hidden_states, top_k_index, top_k_weights)`` as transformers' ``MixtralExperts``)
-- the benchmark's MoE shape, and what expert parallelism (``"expert"``) splits."""
from __future__ import annotations

import torch
from torch import nn


class StackedExperts(nn.Module):
    """SwiGLU experts stored as 3-D tensors; tokens routed to the extra slot ``num_experts`` (or with weight 0)
    add nothing."""

    def __init__(self, experts: int, d_model: int, ff: int):
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * ff, d_model) * d_model ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, d_model, ff) * ff ** -0.5)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            gate, up = nn.functional.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = nn.functional.linear(nn.functional.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


class MoEBlock(nn.Module):
    """Pre-norm residual MoE feed-forward: ``x + experts(norm(x))`` over the top-``top_k`` experts of a softmax
    router, their weights renormalised (Mixtral's)."""

    def __init__(self, d_model: int = 256, experts: int = 8, ff: int = 512, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.norm = nn.RMSNorm(d_model)
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = StackedExperts(experts, d_model, ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = self.norm(x).reshape(-1, shape[-1])
        weights, index = torch.softmax(self.router(h), dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return x + self.experts(h, index, weights).reshape(shape)
