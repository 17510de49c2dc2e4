"""Worker: AUTO_PARALLEL from a plain PyTorch loop (the optimizer made before the first forward): the planner's
runners-up are measured for a few steps each on copies of the network (the measured round), the fastest is kept, and
training afterwards equals one process on the global batch -- the round leaves the network and the optimizer as they
were. argv: OUT_JSON"""
import json
import sys

import torch
from torch.distributed.tensor import DTensor

import autopar
from autopar.communication import get_group_size, get_rank, init
from autopar.context import managed

out = sys.argv[1]
autopar.set_auto_parallel_context(parallel_mode="auto_parallel", gradients_mean=True)
init()
rank, n = get_rank(), get_group_size()
WIDTH, PER_RANK = 512, 4


def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH))


g = torch.Generator().manual_seed(1)
STEPS = 7  # the first six are timed into the plan's table (predicted against measured)
X, Y = torch.randn(STEPS, PER_RANK * n, WIDTH, generator=g), torch.randn(STEPS, PER_RANK * n, WIDTH, generator=g)
net = make()
opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
for step in range(STEPS):
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    loss = torch.nn.functional.mse_loss(net(X[step, mine]), Y[step, mine])
    opt.zero_grad()
    loss.backward()
    opt.step()

ref = make()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
with managed():
    for step in range(STEPS):
        loss = torch.nn.functional.mse_loss(ref(X[step]), Y[step])
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in net.state_dict().items()}
diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
json.dump({"diff": diff}, open(f"{out}.{rank}", "w"))
