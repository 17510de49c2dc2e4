"""A GPT-style decoder the planner can see into, built on the meta device so no size needs its memory.

The attention's two batched matmuls and its softmax are autopar operators (``BatchMatMul``, ``Softmax``), so graph
capture records them as nodes with their own strategies -- the heads, the query rows or the keys can be split --
instead of passing through as element-wise functions. q, k and v come from one fused projection laid out head by
head (Megatron's ``[heads, 3, head_dim]`` order), so a column split of it is exactly a split over heads and its input
gradient is one all-reduce, not three.

``GPTConfig`` also carries the model-level arithmetic the planner reports: the parameter count and the FLOPs per
step of Narayanan et al. 2021 (arXiv 2104.04473, section 5.1), so a plan's model FLOPs utilisation is comparable with
published ones.

``family="llama"`` is the Llama shape (Llama 2/3, Mistral): RMSNorm, rotary positions (no position embedding),
grouped-query attention (``kv_heads`` key/value heads, each shared by ``heads / kv_heads`` query heads), a SwiGLU MLP
(gate and up projections of ``ffn``, then down) and an untied output head. Its attention is laid out by key/value
group -- queries ``[b, kv, group x s, d]`` against keys ``[b, kv, s, d]`` -- so a split of the projections is a split
of the groups all the way through, and tensor parallelism is bounded by ``kv_heads``, as in Megatron.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from autopar.errors import ConfigError
from autopar.ops.math import BatchMatMul, FusedAttention, Softmax

ATTENTION_KERNELS = ("fused", "flash2", "materialized")


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 51200
    ffn: int = 0  # 0: 4 x hidden
    kv_heads: int = 0  # 0: as many as heads (multi-head attention); fewer: grouped-query attention
    family: str = "gpt"  # gpt | llama
    # fused: one kernel, the scores never stored (FlashAttention-3 / cuDNN's on Hopper, as Transformer Engine runs
    # it; FlashAttention-2 on Ampere); flash2: FlashAttention-2's kernel on every GPU (PyTorch's SDPA flash backend,
    # flash-attn 2); materialized: two batched matmuls and a softmax, the s x s scores kept for the backward
    # (Megatron-LM before FlashAttention, 2021-2022)
    attention: str = "fused"
    # 0: hidden / heads; else each head's width, where the attention is wider or narrower than the residual stream
    # (Qwen3-30B-A3B: hidden 2048, 32 heads of 128 -- q and o are 2048 x 4096; GPT-OSS: 2880, 64 heads of 64)
    head_dim: int = 0
    # a mixture of experts (the Llama family: Qwen3-MoE, Mixtral): every layer's SwiGLU MLP is ``experts`` SwiGLU
    # experts of ``expert_ffn`` (0: ``ffn``), each token routed by a linear router to ``top_k`` of them (0: 2) and
    # their outputs summed with the router's weights; 0 experts: a dense MLP
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    # a mixture's companions (DeepSeek-V3, Kimi K2, Moonlight): an always-on SwiGLU of ``shared_expert_ffn`` beside
    # the routed experts (the shared experts together), and the first ``dense_layers`` layers with a dense SwiGLU MLP
    # of ``ffn`` instead of experts
    shared_expert_ffn: int = 0
    dense_layers: int = 0
    # multi-head latent attention (DeepSeek-V2/V3, arXiv 2405.04434 sec. 2.1): keys and values projected up from a
    # latent of ``kv_lora_rank``, queries from one of ``q_lora_rank`` (0: from the residual stream directly); each
    # query and key head ``head_dim`` wide plus ``rope_head_dim`` of rotary positions (one rotary key shared by the
    # heads), each value head ``v_head_dim`` (0: head_dim); 0 kv_lora_rank: grouped-query attention
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0
    # sliding-window attention: ``sliding_layers`` of the layers (0 with a window: all) attend to the latest
    # ``sliding_window`` keys only (GPT-OSS: every other layer, 128 keys; Mistral 7B: every layer, 4,096)
    sliding_window: int = 0
    sliding_layers: int = 0

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPT {name} must be a positive integer, got {value!r}")
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 0:
            raise ConfigError(f"head_dim must be a positive integer (0: hidden / heads), got {self.head_dim!r}")
        if not self.head_dim and self.hidden % self.heads:
            raise ConfigError(f"GPT hidden size {self.hidden} is not divisible by {self.heads} heads")
        if self.family not in ("gpt", "llama"):
            raise ConfigError(f"model family must be gpt or llama, got {self.family!r}")
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError(f"attention must be {', '.join(ATTENTION_KERNELS)}, got {self.attention!r}")
        if isinstance(self.kv_heads, bool) or not isinstance(self.kv_heads, int) or self.kv_heads < 0 \
                or self.heads % self.kv_groups:
            raise ConfigError(f"kv_heads must be a positive divisor of the {self.heads} heads, got {self.kv_heads!r}")
        for name in _DEFAULTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a positive integer (0: {_DEFAULTS[name]}), got {value!r}")
        if self.experts:
            if self.experts < 2:
                raise ConfigError(f"a mixture of experts needs 2 experts or more, got experts = {self.experts}")
            if not self.llama:
                raise ConfigError("a mixture of experts is planned on the Llama shape (SwiGLU experts, RMSNorm, "
                                  "rotary positions): use model llama (autopar plan llama --experts ...)")
            if self.top_k > self.experts:
                raise ConfigError(f"top_k ({self.top_k}) routes each token to more experts than there are "
                                  f"({self.experts})")
            if self.dense_layers >= self.layers:
                raise ConfigError(f"dense_layers ({self.dense_layers}) leaves none of the {self.layers} layers to "
                                  "the experts: give fewer, or no experts")
        elif self.top_k or self.expert_ffn or self.shared_expert_ffn or self.dense_layers:
            raise ConfigError("top_k, expert_ffn, shared_expert_ffn and dense_layers describe a mixture of experts: "
                              "give experts too (--experts N)")
        if self.kv_lora_rank and not self.llama:
            raise ConfigError("multi-head latent attention is planned on the Llama shape (RMSNorm, rotary "
                              "positions): use model llama")
        if not self.kv_lora_rank and (self.q_lora_rank or self.rope_head_dim or self.v_head_dim):
            raise ConfigError("q_lora_rank, rope_head_dim and v_head_dim describe multi-head latent attention: give "
                              "kv_lora_rank too")
        if self.sliding_layers and not self.sliding_window:
            raise ConfigError("sliding_layers names the layers of a sliding window: give sliding_window too")
        if self.sliding_layers > self.layers:
            raise ConfigError(f"sliding_layers ({self.sliding_layers}) is more than the {self.layers} layers")
        if self.sliding_window and self.attention == "materialized":
            raise ConfigError("a sliding window is planned on fused attention (its kernel skips the blocks outside "
                              "the band): use --attention fused or flash2")
        if self.kv_lora_rank and self.kv_heads not in (0, self.heads):
            raise ConfigError("multi-head latent attention gives every query head its own key and value head: "
                              f"kv_heads must be {self.heads} (or unset), got {self.kv_heads}")

    @property
    def kv_groups(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def attention_width(self) -> int:
        """The queries' (and the attention output's) width: heads x head size -- the hidden size unless
        ``head_dim`` says otherwise."""
        return self.heads * self.head_size

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head(self) -> int:
        """A query's (and a key's) head width: with latent attention its rotary part too."""
        return self.head_size + self.rope_head_dim

    @property
    def v_head(self) -> int:
        return self.v_head_dim or self.head_size

    @property
    def windowed_layers(self) -> int:
        """The layers whose attention is the sliding window's (all of them where ``sliding_layers`` is 0)."""
        return (self.sliding_layers or self.layers) if self.sliding_window else 0

    def window_share(self) -> float:
        """The share of the causal query-key pairs a windowed layer computes (``ops.math.FusedAttention``)."""
        from autopar.ops.math import FusedAttention

        return FusedAttention(self.sliding_window).window_share(self.seq)

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def llama(self) -> bool:
        return self.family == "llama"

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def experts_chosen(self) -> int:
        """Experts a token is routed to (``top_k``, 2 where unset)."""
        return self.top_k or 2

    @property
    def expert_ffn_size(self) -> int:
        return self.expert_ffn or self.ffn_size

    @property
    def expert_layers(self) -> int:
        """The layers whose MLP is the experts (all but ``dense_layers``; none of a dense model)."""
        return self.layers - self.dense_layers if self.moe else 0

    def _attention_weights(self) -> int:
        """One layer's attention projections: q, k, v and o; with latent attention the down-projections to the
        latents, their RMSNorms, the up-projections from them, and o."""
        h, heads = self.hidden, self.heads
        if not self.mla:
            a, kv = self.attention_width, self.kv_groups * self.head_size
            return 2 * h * a + 2 * h * kv
        q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.qk_head if self.q_lora_rank
             else h * heads * self.qk_head)
        kv = h * (self.kv_lora_rank + self.rope_head_dim) + self.kv_lora_rank \
            + self.kv_lora_rank * heads * (self.head_size + self.v_head)
        return q + kv + heads * self.v_head * h

    def _mlp_weights(self, active: bool, experts: bool = True) -> int:
        """A layer's MLP weights: the dense SwiGLU / GELU MLP's, or (``experts``, a mixture's layers) the routed
        experts' (``active``: the ``top_k`` a token runs), the router's and the shared experts'."""
        h = self.hidden
        if not (self.moe and experts):
            return (3 if self.llama else 2) * h * self.ffn_size
        routed = (self.experts_chosen if active else self.experts) * 3 * h * self.expert_ffn_size
        return routed + h * self.experts + 3 * h * self.shared_expert_ffn

    def _layers_weights(self, active: bool) -> int:
        """Every decoder layer's projection weights (the attention's and the MLP's)."""
        dense = self.layers - self.expert_layers
        return (self.layers * self._attention_weights() + self.expert_layers * self._mlp_weights(active)
                + dense * self._mlp_weights(active, experts=False))

    @property
    def parameters(self) -> int:
        """Exact count of this module's parameters (GPT: embeddings tied with the output head)."""
        h, f, a = self.hidden, self.ffn_size, self.attention_width
        if self.llama:  # no biases; the projections; two RMSNorms a layer; untied head, final norm
            return self._layers_weights(active=False) + self.layers * 2 * h + 2 * self.vocab * h + h
        layer = 3 * h * a + 3 * a + (a * h + h) + (h * f + f) + (f * h + h) + 4 * h
        return self.layers * layer + self.vocab * h + self.seq * h + 2 * h

    def model_flops(self, global_batch: int, recompute: bool | str = False) -> float:
        """FLOPs of one training step, the matmuls only (Narayanan et al.): per token and layer 2 x (the projections'
        weights) + 4 s h for the attention, x3 for forward and backward (x4 with full recompute), plus the output
        head's 6 h V (with ``head_dim``, q and o are h x heads x head_dim and the attention 4 s heads head_dim; with
        latent attention 2 s heads (qk_head + v_head); a mixture counts the experts a token runs).
        For the GPT shape this is 72 B s l h^2 (1 + s/6h + V/12lh), 96 ... (V/16lh) with recompute.
        ``recompute="selective"`` adds the attention core's forward once more, 4 s h per token and layer (Korthikanti
        et al. 2022, arXiv 2205.05198 sec. 5)."""
        b, s, l, h, v = global_batch, self.seq, self.layers, self.hidden, self.vocab
        core = 2.0 * s * self.heads * (self.qk_head + self.v_head)  # q k^T and p v, a token (4 s h for the GPT shape)
        if self.sliding_window:  # the windowed layers' pairs, as their kernel's share of the causal ones
            core *= 1.0 - self.windowed_layers / l * (1.0 - self.window_share())
        per_token = 2.0 * self._layers_weights(active=True) + l * core
        if recompute == "selective":
            return b * s * (3.0 * per_token + l * core + 6.0 * h * v)
        passes = 4.0 if recompute else 3.0
        return b * s * (passes * per_token + 6.0 * h * v)

    def describe(self) -> str:
        name = "Llama" if self.llama else "GPT"
        heads = f"{self.heads} heads" + (f" of {self.head_dim}" if self.head_dim else "") + (
            f" ({self.kv_groups} key/value)" if self.kv_groups != self.heads else "")
        if self.sliding_window:
            heads += (f", a sliding window of {self.sliding_window} in " + ("every layer" if self.windowed_layers
                      == self.layers else f"{self.windowed_layers} layers"))
        if self.mla:
            heads += f", latent attention (kv rank {self.kv_lora_rank}" + (
                f", q rank {self.q_lora_rank}" if self.q_lora_rank else "") + ")"
        experts = ""
        if self.moe:
            experts = (f", {self.experts} experts of {self.expert_ffn_size} (top {self.experts_chosen}"
                       + (f", shared {self.shared_expert_ffn}" if self.shared_expert_ffn else "")
                       + ((", the first layer dense" if self.dense_layers == 1 else
                           f", the first {self.dense_layers} layers dense") if self.dense_layers else "")
                       + f"; {self.active_parameters / 1e9:.1f}B active)")
        return (f"{name} {self.parameters / 1e9:.1f}B: {self.layers} layers, hidden {self.hidden}, {heads}{experts}, "
                f"sequence {self.seq}, vocabulary {self.vocab}, {self.attention} attention")

    @property
    def active_parameters(self) -> int:
        """The parameters a token runs through: a mixture's ``top_k`` experts of each layer, not all of them."""
        return self.parameters - (self._layers_weights(active=False) - self._layers_weights(active=True))


_DEFAULTS = {"sliding_window": "no window", "sliding_layers": "every layer", "experts": "a dense MLP", "top_k": "2", "expert_ffn": "ffn", "shared_expert_ffn": "none",
             "dense_layers": "none", "kv_lora_rank": "grouped-query attention", "q_lora_rank": "no query latent",
             "rope_head_dim": "none", "v_head_dim": "head_dim"}


PRESETS = {  # GPT-3's shapes (Brown et al. 2020, table 2.1) with Megatron's vocabulary
    "1.3b": GPTConfig(24, 2048, 16),
    "13b": GPTConfig(40, 5120, 40),
    "175b": GPTConfig(96, 12288, 96),
    # Llama 3 (Meta 2024, table 3): 8B and 70B, sequence 8192, vocabulary 128256, GQA with 8 key/value heads
    "llama3-8b": GPTConfig(32, 4096, 32, seq=8192, vocab=128256, ffn=14336, kv_heads=8, family="llama"),
    "llama3-70b": GPTConfig(80, 8192, 64, seq=8192, vocab=128256, ffn=28672, kv_heads=8, family="llama"),
    # mixtures of experts, from their Hugging Face config.json files: Qwen3-30B-A3B and Qwen3-235B-A22B
    # (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B: 128 experts, 8 a token, 4 key/value heads of 128; pretrained at
    # 4,096 tokens), Mixtral 8x7B and 8x22B (mistralai/Mixtral-8x7B-v0.1, Mixtral-8x22B-v0.1: 8 experts, 2 a token)
    "qwen3-30b-a3b": GPTConfig(48, 2048, 32, seq=4096, vocab=151936, kv_heads=4, family="llama", head_dim=128,
                               experts=128, top_k=8, expert_ffn=768),
    "qwen3-235b-a22b": GPTConfig(94, 4096, 64, seq=4096, vocab=151936, kv_heads=4, family="llama", head_dim=128,
                                 experts=128, top_k=8, expert_ffn=1536),
    "mixtral-8x7b": GPTConfig(32, 4096, 32, seq=4096, vocab=32000, ffn=14336, kv_heads=8, family="llama",
                              experts=8, top_k=2),
    "mixtral-8x22b": GPTConfig(56, 6144, 48, seq=4096, vocab=32768, ffn=16384, kv_heads=8, family="llama",
                               experts=8, top_k=2),
    # latent attention, shared experts and dense first layers, from config.json: DeepSeek-V3 (deepseek-ai/DeepSeek-V3:
    # 61 layers, the first 3 dense; 256 routed experts of 2048, 8 a token, one shared; q / kv latents of 1536 / 512,
    # heads of 128 + 64 rotary; pretrained at 4,096 tokens -- its multi-token-prediction module is not counted),
    # Kimi K2 (moonshotai/Kimi-K2-Base: 384 experts, 64 heads, the first layer dense), Moonlight-16B-A3B
    # (moonshotai/Moonlight-16B-A3B: no query latent, 64 experts of 1408, 6 a token, two shared)
    "deepseek-v3": GPTConfig(61, 7168, 128, seq=4096, vocab=129280, ffn=18432, family="llama", head_dim=128,
                             experts=256, top_k=8, expert_ffn=2048, shared_expert_ffn=2048, dense_layers=3,
                             kv_lora_rank=512, q_lora_rank=1536, rope_head_dim=64, v_head_dim=128),
    "kimi-k2": GPTConfig(61, 7168, 64, seq=4096, vocab=163840, ffn=18432, family="llama", head_dim=128,
                         experts=384, top_k=8, expert_ffn=2048, shared_expert_ffn=2048, dense_layers=1,
                         kv_lora_rank=512, q_lora_rank=1536, rope_head_dim=64, v_head_dim=128),
    # GPT-OSS (openai/gpt-oss-120b, gpt-oss-20b config.json: 64 heads of 64 over 2,880, 8 key/value; 128 / 32 experts
    # of 2,880, 4 a token; every other layer a sliding window of 128 keys -- its attention sinks, a scalar a head,
    # and its projections' biases are not counted)
    "gpt-oss-120b": GPTConfig(36, 2880, 64, seq=4096, vocab=201088, kv_heads=8, family="llama", head_dim=64,
                              experts=128, top_k=4, expert_ffn=2880, sliding_window=128, sliding_layers=18),
    "gpt-oss-20b": GPTConfig(24, 2880, 64, seq=4096, vocab=201088, kv_heads=8, family="llama", head_dim=64,
                             experts=32, top_k=4, expert_ffn=2880, sliding_window=128, sliding_layers=12),
    "moonlight-16b-a3b": GPTConfig(27, 2048, 16, seq=8192, vocab=163842, ffn=11264, family="llama", head_dim=128,
                                   experts=64, top_k=6, expert_ffn=1408, shared_expert_ffn=2816, dense_layers=1,
                                   kv_lora_rank=512, rope_head_dim=64, v_head_dim=128),
}


class GPTLayer(nn.Module):
    """Pre-norm decoder layer: causal self-attention and a GELU feed-forward, each with a residual."""

    def __init__(self, hidden: int, heads: int, ffn: int, fused: bool = True, head_dim: int = 0):
        super().__init__()
        self.heads, self.d = heads, head_dim or hidden // heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * heads * self.d)
        self.attention = _Attention(fused)
        self.proj = nn.Linear(heads * self.d, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.d
        qkv = self.qkv(self.ln1(x)).reshape(b, s, self.heads, 3 * d)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(d, dim=-1))
        ctx = self.attention(q, k, v).transpose(1, 2).reshape(b, s, self.heads * d)
        x = x + self.proj(ctx)
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class LlamaLayer(nn.Module):
    """Pre-norm Llama decoder layer: RMSNorm, grouped-query causal attention (rotary positions are element-wise on
    q and k: costed with the element-wise work), a SwiGLU MLP."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, fused: bool = True, head_dim: int = 0,
                 experts: bool = False):
        """``experts``: a mixture-of-experts layer as the planner captures it -- the attention, its residual, the
        norm before the MLP and the shared experts' SwiGLU of ``ffn`` (none where 0); the router and the routed
        experts, whose work depends on where the experts live (expert parallelism) rather than on a layout of these
        operators, are costed by ``cluster/experts.py``."""
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.d = d = head_dim or hidden // heads
        self.norm1 = nn.RMSNorm(hidden)
        self._projections(hidden, heads, kv_heads, d)
        self.attention = _Attention(fused)
        self.norm2 = nn.RMSNorm(hidden)
        self.experts = experts
        self.mlp = ffn > 0 or not experts
        if self.mlp:
            self.gate = nn.Linear(hidden, ffn, bias=False)
            self.up = nn.Linear(hidden, ffn, bias=False)
            self.down = nn.Linear(ffn, hidden, bias=False)

    def _projections(self, hidden: int, heads: int, kv_heads: int, d: int) -> None:
        self.q = nn.Linear(hidden, heads * d, bias=False)  # laid out [kv group, queries of the group, d]
        self.kv = nn.Linear(hidden, 2 * kv_heads * d, bias=False)  # [kv group, k and v, d]
        self.o = nn.Linear(heads * d, hidden, bias=False)

    def _attend(self, y: torch.Tensor) -> torch.Tensor:
        """The attention's output ``[b, s, heads x value head]``, from the normed input."""
        b, s, _ = y.shape
        kv, d = self.kv_heads, self.d
        g = self.heads // kv
        q = self.q(y).reshape(b, s, kv, g, d).permute(0, 2, 3, 1, 4).reshape(b, kv, g * s, d)
        k, v = (t.transpose(1, 2) for t in self.kv(y).reshape(b, s, kv, 2 * d).split(d, dim=-1))
        return self.attention(q, k, v).reshape(b, kv, g, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, self.heads * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.o(self._attend(self.norm1(x)))
        y = self.norm2(x)
        out = x + self.down(nn.functional.silu(self.gate(y)) * self.up(y)) if self.mlp else x
        return out + y if self.experts else out  # the routed experts' output (their input's shape) joins too


class LatentLayer(LlamaLayer):
    """A Llama layer with multi-head latent attention (DeepSeek-V2/V3's, arXiv 2405.04434 sec. 2.1): the input
    projected down to a query latent (``q_down``, normed; or straight to the queries without one) and to a key/value
    latent with one rotary key (``kv_down``, normed), each latent up to the heads (``q_up``: queries of ``d + r``;
    ``kv_up``: keys' non-rotary ``d`` and values' ``e``), the shared rotary key appended to every head's key, and
    ``o`` from the heads' values. Tensor parallelism splits the up-projections by heads and ``o`` by rows, as
    Megatron-Core does; the down-projections are whole on every rank of the group."""

    def __init__(self, hidden: int, heads: int, ffn: int, fused: bool, head_dim: int, experts: bool,
                 q_rank: int, kv_rank: int, rope: int, v_head: int):
        self.q_rank, self.kv_rank, self.rope, self.e = q_rank, kv_rank, rope, v_head
        super().__init__(hidden, heads, heads, ffn, fused, head_dim, experts)

    def _projections(self, hidden: int, heads: int, kv_heads: int, d: int) -> None:
        if self.q_rank:
            self.q_down = nn.Linear(hidden, self.q_rank, bias=False)
            self.q_norm = nn.RMSNorm(self.q_rank)
            self.q_up = nn.Linear(self.q_rank, heads * (d + self.rope), bias=False)
        else:
            self.q = nn.Linear(hidden, heads * (d + self.rope), bias=False)
        self.kv_down = nn.Linear(hidden, self.kv_rank + self.rope, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_rank)
        self.kv_up = nn.Linear(self.kv_rank, heads * (d + self.e), bias=False)
        self.o = nn.Linear(heads * self.e, hidden, bias=False)

    def _attend(self, y: torch.Tensor) -> torch.Tensor:
        b, s, _ = y.shape
        h, d, e, r = self.heads, self.d, self.e, self.rope
        q = self.q_up(self.q_norm(self.q_down(y))) if self.q_rank else self.q(y)
        q = q.reshape(b, s, h, d + r).transpose(1, 2)
        latent, rotary = self.kv_down(y).split([self.kv_rank, r], dim=-1)
        k, v = self.kv_up(self.kv_norm(latent)).reshape(b, s, h, d + e).split([d, e], dim=-1)
        k = torch.cat([k, rotary.unsqueeze(2).expand(b, s, h, r)], dim=-1).transpose(1, 2)
        return self.attention(q, k, v.transpose(1, 2)).transpose(1, 2).reshape(b, s, h * e)


class _Attention(nn.Module):
    """Causal attention of q ``[b, heads, g x s, d]`` (``g`` query heads per key/value head stacked on the rows, row
    ``r`` at position ``r % s``) against k, v ``[b, heads, s, d]``: one fused operator, or the scores materialized --
    two batched matmuls and a softmax, each a node the planner lays out (and whose ``s x s`` activation it counts)."""

    def __init__(self, fused: bool):
        super().__init__()
        self.fused = FusedAttention() if fused else None
        if not fused:
            self.scores = BatchMatMul(transpose_b=True)
            self.softmax = Softmax(-1)
            self.context = BatchMatMul()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(q, k, v)
        s, d = k.shape[2], k.shape[3]
        scores = self.scores(q, k) / math.sqrt(d)
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1).repeat(q.shape[2] // s, 1)
        return self.context(self.softmax(scores.masked_fill(mask, float("-inf"))), v)


def make_layer(config: GPTConfig, dense: bool = False, window: bool = False) -> nn.Module:
    """One decoder layer of ``config``: a mixture's layer (its attention half and shared experts; ``cluster/
    experts.py`` costs the routed experts), or with ``dense`` one of its dense layers (``dense_layers``); with
    ``window`` one whose attention is the sliding window's."""
    c = config
    fused = c.attention != "materialized"
    if not c.llama:
        layer = GPTLayer(c.hidden, c.heads, c.ffn_size, fused, c.head_dim)
    else:
        experts = c.moe and not dense
        ffn = c.shared_expert_ffn if experts else c.ffn_size
        layer = LatentLayer(c.hidden, c.heads, ffn, fused, c.head_dim, experts, c.q_lora_rank, c.kv_lora_rank,
                            c.rope_head_dim, c.v_head) if c.mla else LlamaLayer(
            c.hidden, c.heads, c.kv_groups, ffn, fused, c.head_dim, experts)
    if window:
        layer.attention.fused.window = c.sliding_window
    return layer


class GPTHead(nn.Module):
    """Final norm and the vocabulary projection (tied with the token embedding in :class:`GPT`)."""

    def __init__(self, hidden: int, vocab: int, rms: bool = False):
        super().__init__()
        self.ln_f = nn.RMSNorm(hidden) if rms else nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln_f(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        c = config
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.hidden)
        self.wpe = None if c.llama else nn.Embedding(c.seq, c.hidden)
        self.layers = nn.ModuleList(make_layer(c) for _ in range(c.layers))
        self.head = GPTHead(c.hidden, c.vocab, rms=c.llama)
        if not c.llama:
            self.head.out.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class TokenLoss(nn.Module):
    """Next-token cross entropy over (batch, sequence, vocabulary) logits."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
