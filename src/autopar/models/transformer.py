"""A pre-norm transformer block of plain ``nn.Linear`` layers (q, k, v, projection, feed-forward): the benchmark's
third model shape, and what Megatron-style tensor parallelism was designed for."""
from __future__ import annotations

import math

import torch
from torch import nn


class TransformerBlock(nn.Module):
    def __init__(self, d_model: int = 512, heads: int = 8, ff: int = 2048):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not divisible by heads {heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff1 = nn.Linear(d_model, ff)
        self.act = nn.GELU()
        self.ff2 = nn.Linear(ff, d_model)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        b, s, d = t.shape
        return t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.ln1(x)
        q, k, v = self._split(self.q(h)), self._split(self.k(h)), self._split(self.v(h))
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // self.heads), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.ff2(self.act(self.ff1(self.ln2(x))))


class LlamaBlock(nn.Module):
    """A Llama-style decoder layer: RMSNorm, grouped-query attention (``kv_heads`` key/value heads shared by
    ``heads / kv_heads`` query heads each) with rotary position embeddings, and a SwiGLU MLP -- the shape of
    today's open models, as plain ``nn.Linear`` layers (q, k, v, o, gate, up, down). ``causal=True``: causal
    attention through ``F.scaled_dot_product_attention`` (the fused kernel, as long-context training runs it)
    instead of the bidirectional softmax of an explicit score matrix."""

    def __init__(self, d_model: int = 512, heads: int = 8, kv_heads: int = 2, ff: int = 1408, seq: int = 128,
                 causal: bool = False):
        super().__init__()
        self.causal = causal
        if d_model % heads or heads % kv_heads:
            raise ValueError(f"d_model {d_model}, heads {heads}, kv_heads {kv_heads}: heads must divide d_model and "
                             f"kv_heads heads")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d_model // heads
        self.norm1 = nn.RMSNorm(d_model)
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.norm2 = nn.RMSNorm(d_model)
        self.gate = nn.Linear(d_model, ff, bias=False)
        self.up = nn.Linear(d_model, ff, bias=False)
        self.down = nn.Linear(ff, d_model, bias=False)
        half = self.head_dim // 2
        freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        angle = torch.outer(torch.arange(seq, dtype=torch.float32), freq)
        self.register_buffer("cos", angle.cos(), persistent=False)
        self.register_buffer("sin", angle.sin(), persistent=False)

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = t.shape
        return t.reshape(b, s, n, self.head_dim).transpose(1, 2)

    def _rotate(self, t: torch.Tensor) -> torch.Tensor:
        s, half = t.shape[-2], self.head_dim // 2
        cos, sin = self.cos[:s].to(t.dtype), self.sin[:s].to(t.dtype)
        a, b = t[..., :half], t[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm1(x)
        q = self._rotate(self._heads(self.q(h), self.heads))
        k = self._rotate(self._heads(self.k(h), self.kv_heads))
        v = self._heads(self.v(h), self.kv_heads)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if self.causal:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.head_dim), dim=-1) @ v
        y = y.transpose(1, 2).reshape(b, s, d)
        x = x + self.o(y)
        h = self.norm2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))
