"""A GPT-style decoder the planner can see into, built on the meta device so no size needs its memory.

The attention's two batched matmuls and its softmax are autopar operators (``BatchMatMul``, ``Softmax``), so graph
capture records them as nodes with their own strategies -- the heads, the query rows or the keys can be split --
instead of passing through as element-wise functions. q, k and v come from one fused projection laid out head by
head (Megatron's ``[heads, 3, head_dim]`` order), so a column split of it is exactly a split over heads and its input
gradient is one all-reduce, not three.

``GPTConfig`` also carries the model-level arithmetic the planner reports: the parameter count and the FLOPs per
step of Narayanan et al. 2021 (arXiv 2104.04473, section 5.1), so a plan's model FLOPs utilisation is comparable with
published ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from autopar.errors import ConfigError
from autopar.ops.math import BatchMatMul, Softmax


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 51200
    ffn: int = 0  # 0: 4 x hidden

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPT {name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ConfigError(f"GPT hidden size {self.hidden} is not divisible by {self.heads} heads")

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def parameters(self) -> int:
        """Exact count of this module's parameters (embeddings tied with the output head)."""
        h, f = self.hidden, self.ffn_size
        layer = 3 * h * h + 3 * h + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        return self.layers * layer + self.vocab * h + self.seq * h + 2 * h

    def model_flops(self, global_batch: int, recompute: bool = False) -> float:
        """FLOPs of one training step: 72 B s l h^2 (1 + s/6h + V/12lh), 96 ... (V/16lh) with full recompute."""
        b, s, l, h, v = global_batch, self.seq, self.layers, self.hidden, self.vocab
        if recompute:
            return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
        return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))

    def describe(self) -> str:
        return (f"GPT {self.parameters / 1e9:.1f}B: {self.layers} layers, hidden {self.hidden}, {self.heads} heads, "
                f"sequence {self.seq}, vocabulary {self.vocab}")


PRESETS = {  # GPT-3's shapes (Brown et al. 2020, table 2.1) with Megatron's vocabulary
    "1.3b": GPTConfig(24, 2048, 16),
    "13b": GPTConfig(40, 5120, 40),
    "175b": GPTConfig(96, 12288, 96),
}


class GPTLayer(nn.Module):
    """Pre-norm decoder layer: causal self-attention and a GELU feed-forward, each with a residual."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.scores = BatchMatMul(transpose_b=True)
        self.softmax = Softmax(-1)
        self.context = BatchMatMul()
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads
        qkv = self.qkv(self.ln1(x)).reshape(b, s, self.heads, 3 * d)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(d, dim=-1))
        scores = self.scores(q, k) / math.sqrt(d)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        att = self.softmax(scores.masked_fill(mask, float("-inf")))
        ctx = self.context(att, v).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(ctx)
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class GPTHead(nn.Module):
    """Final layer norm and the vocabulary projection (tied with the token embedding in :class:`GPT`)."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.ln_f = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln_f(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        c = config
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.hidden)
        self.wpe = nn.Embedding(c.seq, c.hidden)
        self.layers = nn.ModuleList(GPTLayer(c.hidden, c.heads, c.ffn_size) for _ in range(c.layers))
        self.head = GPTHead(c.hidden, c.vocab)
        self.head.out.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class TokenLoss(nn.Module):
    """Next-token cross entropy over (batch, sequence, vocabulary) logits."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
