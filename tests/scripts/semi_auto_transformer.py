"""Worker: a pre-norm transformer block of torch Linears in the Megatron pattern (q, k, v, ff1 split by columns, proj
and ff2 by rows), its attention written with torch's ``@`` and ``softmax`` on the head-split tensors, trained by a
plain PyTorch loop in SEMI_AUTO_PARALLEL; compared with one process on the global batches: the loss of every step and
the parameters after 3 steps. On 4 ranks the heads are split over both axes of the 2 x 2 device mesh. Then the same
for a Llama-style block (RMSNorm, grouped-query attention, a rotary table kept as a plain buffer -- met by DTensors in
the forward and again by autograd in the backward -- and SwiGLU).

argv: OUT_JSON. Writes the largest differences to OUT_JSON.<rank> (the Llama block's under "llama_*").
"""
import copy
import json
import sys

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import autopar
from autopar.communication import get_group_size, get_rank, init
from autopar.context import managed
from autopar.models import LlamaBlock, TransformerBlock

out_path = sys.argv[1]
autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True)
init()
rank, n = get_rank(), get_group_size()
STEPS, GLOBAL, SEQ, D = 3, 8, 6, 32
g = torch.Generator().manual_seed(0)
X = torch.randn(STEPS, GLOBAL, SEQ, D, generator=g)
Y = torch.randn(STEPS, GLOBAL, SEQ, D, generator=g)

def train(make, columns, rows_):
    torch.manual_seed(0)
    ref = make()
    net = copy.deepcopy(ref)
    col, row = ((1, 1, 1), (n, 1)), ((1, 1, n), (1, n))
    for name in columns:
        autopar.shard(getattr(net, name), col)
    for name in rows_:
        autopar.shard(getattr(net, name), row)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    rows = slice(rank * GLOBAL // n, (rank + 1) * GLOBAL // n)
    loss_diff = 0.0
    for step in range(STEPS):
        loss = F.mse_loss(net(X[step, rows]), Y[step, rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        with managed():  # the reference is one process: its first call must not parallelize it
            ref_loss = F.mse_loss(ref(X[step]), Y[step])
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        loss_diff = max(loss_diff, abs(mean.item() / n - ref_loss.item()))
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in net.state_dict().items()}
    param_diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    local = {k: (p.to_local() if isinstance(p, DTensor) else p).numel() for k, p in net.named_parameters()}
    return loss_diff, param_diff, local


loss_diff, param_diff, local = train(lambda: TransformerBlock(D, 4, 64), ("q", "k", "v", "ff1"), ("proj", "ff2"))
llama_loss, llama_param, llama_local = train(lambda: LlamaBlock(D, 8, 4, 48, SEQ), ("q", "k", "v", "gate", "up"),
                                             ("o", "down"))
json.dump({"loss": loss_diff, "param": param_diff, "q_local": local["q.weight"], "q_full": D * D,
           "llama_loss": llama_loss, "llama_param": llama_param, "llama_k_local": llama_local["k.weight"]},
          open(f"{out_path}.{rank}", "w"))
print(f"RANK {rank} loss {loss_diff:.2e} param {param_diff:.2e}", flush=True)
