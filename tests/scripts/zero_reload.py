"""Worker: a sliced checkpoint of 4 ZeRO-3 ranks (zero_train.py's level3 / AdamW / plain loop, after 5 steps, with
its optimizer state) resumed on other layouts: plain DATA_PARALLEL on this job's ranks trains step 6 and saves its
own sliced checkpoint; then (``single``) one process resumes that one and trains step 7. Each compares with one
process that trained 6 (7) steps without stopping -- equal only if the optimizer state (AdamW's moments and step)
travelled too.

argv: ZERO_CKPT_DIR DP_CKPT_DIR OUT [single]
"""
import json
import sys

import numpy as np
import torch

import autopar
from autopar.communication import get_group_size, get_rank, init

zero_dir, dp_dir, out = sys.argv[1], sys.argv[2], sys.argv[3]
SINGLE = len(sys.argv) > 4 and sys.argv[4] == "single"
SAVED_BY, LOCAL = 4, 4  # zero_train.py on 4 ranks, 4 samples each
rng = np.random.default_rng(0)  # zero_train.py's data for steps 1-5, then two more global batches
X = torch.tensor(rng.standard_normal((5, LOCAL * SAVED_BY, 8)).astype(np.float32))
Y = torch.tensor(rng.integers(0, 5, (5, LOCAL * SAVED_BY)))
more = np.random.default_rng(1)
X = torch.cat([X, torch.tensor(more.standard_normal((2, 16, 8)).astype(np.float32))])
Y = torch.cat([Y, torch.tensor(more.integers(0, 5, (2, 16)))])


def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))


def reference(steps: int) -> dict:
    with autopar.context.managed():
        net = make()
        opt = torch.optim.AdamW(net.parameters(), lr=0.01)
        for step in range(steps):
            torch.nn.functional.cross_entropy(net(X[step]), Y[step]).backward()
            opt.step()
            opt.zero_grad()
    return {k: v.detach() for k, v in net.named_parameters()}


def diff(net, ref) -> float:
    got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in net.named_parameters()}
    return max(float((got[k] - ref[k]).abs().max()) for k in ref)


if SINGLE:  # one process, stand-alone: the 2 data-parallel ranks' slices -> full tensors, optimizer included
    net = make()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    autopar.load_distributed_checkpoint(net, [f"{dp_dir}/rank_{r}.ckpt" for r in range(2)], optimizer=opt)
    torch.nn.functional.cross_entropy(net(X[6]), Y[6]).backward()
    opt.step()
    json.dump({"diff": diff(net, reference(7))}, open(out, "w"))
    sys.exit(0)

autopar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
init()
rank, n = get_rank(), get_group_size()
net = make()
opt = torch.optim.AdamW(net.parameters(), lr=0.01)
autopar.load_distributed_checkpoint(net, [f"{zero_dir}/rank_{r}.ckpt" for r in range(SAVED_BY)], optimizer=opt)
share = 16 // n
x, y = X[5][rank * share:(rank + 1) * share], Y[5][rank * share:(rank + 1) * share]
torch.nn.functional.cross_entropy(net(x), y).backward()
opt.step()
opt.zero_grad()
autopar.save_checkpoint(net, f"{dp_dir}/rank_{rank}", integrated_save=False, optimizer=opt)
json.dump({"diff": diff(net, reference(6)), "steps": int(next(iter(opt.state.values()))["step"])},
          open(f"{out}.{rank}", "w"))
print(f"RANK {rank} DONE", flush=True)
