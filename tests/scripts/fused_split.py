"""Worker: fused q, k, v projections split by columns on 2 ranks, float64, one forward and backward against one
process (tests/parallel/test_fused_split.py):

- ``nanogpt4``: nanoGPT's ``c_attn(x).split(n_embd, dim=2)`` with 4 heads -- q, k and v each split by heads (one
  all-to-all), attention's output reaching the row-split ``c_proj`` split;
- ``nanogpt3``: 3 heads, which 2 ranks do not divide -- q, k and v gathered whole as DTensor does (exact, unsplit);
- ``heads_first``: BLOOM's layout, ``qkv(x).view(B, T, heads, 3, head_dim)`` -- the heads split where they lie, no
  all-to-all.

argv: OUT_PREFIX. Writes {case: {...}} to OUT_PREFIX.<rank>.
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import autopar

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpt import GPT, GPTConfig  # noqa: E402

autopar.communication.init()
rank = autopar.communication.get_rank()
torch.set_default_dtype(torch.float64)


class HeadsFirst(torch.nn.Module):
    def __init__(self, hidden=16, heads=4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, self.heads, 3, c // self.heads).unbind(3)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


def build(case):
    torch.manual_seed(0)
    if case == "heads_first":
        return HeadsFirst(), {"qkv": "colwise", "out": "rowwise"}, "out"
    heads = int(case[-1])
    model = GPT(GPTConfig(bias=False, block_size=8, n_head=heads, n_embd=8 * heads, n_layer=1, vocab_size=64))
    return model, {"*.c_attn": "colwise", "*.c_proj": "rowwise"}, "transformer.h.0.attn.c_proj"


def loss_of(model, case, data):
    if case == "heads_first":
        return model(data).square().mean()
    return model(data[:, :-1].contiguous(), data[:, 1:].contiguous())[1]


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


out = {}
for case in ("nanogpt4", "nanogpt3", "heads_first"):
    autopar.reset_auto_parallel_context()
    g = torch.Generator().manual_seed(1)
    data = torch.randn(2, 8, 16, generator=g) if case == "heads_first" else torch.randint(0, 64, (2, 9), generator=g)
    ref, _, _ = build(case)
    loss_of(ref, case, data).backward()
    autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", full_batch=True)
    model, plan, proj = build(case)
    autopar.shard(model, plan)
    seen = {}
    model.get_submodule(proj).register_forward_pre_hook(lambda m, a, seen=seen: seen.update(
        placements=str(tuple(a[0].placements)), local=a[0].to_local().shape[-1], whole=a[0].shape[-1]))
    loss = loss_of(model, case, data)
    loss.backward()
    grads = dict(ref.named_parameters())
    out[case] = {"loss": abs(full(loss).item() - loss_of(ref, case, data).item()),
                 "grad": max((full(p.grad) - grads[n].grad).abs().max().item() for n, p in model.named_parameters()),
                 "attended": seen}
json.dump(out, open(f"{sys.argv[1]}.{rank}", "w"))
