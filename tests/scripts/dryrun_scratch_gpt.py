"""A GPT written from scratch, not the suite's nanoGPT (issue 55's check of the dry run): SDPA attention, qkv and fc
split by columns, proj and out by rows with ``autopar.shard`` tuples, an untied head, AdamW, SEMI_AUTO.
argv: [mt] -- mt: measure the real run's peak with torch's own MemTracker (its first step made outside, as
MemTracker needs the parameters as they train) and print it; otherwise just train 3 steps."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(d); self.qkv = nn.Linear(d, 3 * d); self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d); self.fc = nn.Linear(d, 4 * d); self.out = nn.Linear(4 * d, d)
    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

class GPT(nn.Module):
    def __init__(self, vocab=512, d=256, h=8, layers=2, block=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d); self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(layers)); self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks: x = blk(x)
        return self.head(self.ln(x))

which = sys.argv[1] if len(sys.argv) > 1 else "plain"
autopar.init()
n = autopar.get_group_size()
autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True)
torch.manual_seed(0)
model = GPT()
for name, m in model.named_modules():
    if name.endswith(("qkv", "fc")): autopar.shard(m, ((1, 1, 1), (n, 1)))
    elif name.endswith(("proj", "out")): autopar.shard(m, ((1, 1, n), (1, n)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
def step():
    x = torch.randint(0, 512, (4, 64)); y = torch.randint(0, 512, (4, 64))
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
if which == "mt":
    from torch.distributed._tools.mem_tracker import MemTracker
    step()
    mt = MemTracker(); mt.track_external(model, opt)
    with mt:
        for _ in range(2):
            step(); mt.reset_mod_stats()
    peak = mt.get_tracker_snapshot("peak")
    print(f"MemTracker peak {peak[torch.device('cpu')]['Total']}", flush=True)
else:
    for _ in range(3): step()
    print("done", flush=True)
