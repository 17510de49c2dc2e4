"""Worker: AUTO_PARALLEL picks the plan (with a real calibration of this machine) for an MLP that does not fit the
per-device memory limit under data parallelism; the plan trains 3 steps and must equal the unsharded MLP trained in
one process. argv: OUT_JSON [zero|pipeline]

- default: 4 x Linear(512, 512), 8 samples per rank: 4 MiB of weights, x3 with gradients and momentum = 12 MiB under
  data parallel; 7.5 MB fits a layout of sharded weights (6.2 MB) but not ZeRO level 3 (8.1 MB): the searched plan.
- ``zero``: 4 x Linear(256, 256), 2048 samples per rank: the activations dominate, every layout of the operators
  needs 19.0 MB (data parallel splits them best), ZeRO level 3 18.0 MB: under 18.3 MB only ZeRO level 3 fits.
- ``pipeline`` (4 ranks): 8 x Linear(256, 256), 512 samples per rank: every layout needs 14 MB, ZeRO level 3 10 MB,
  a pipeline of 2 stages x 2 replicas 3.6 MB (4 x 1: 2.3 MB): under 6 MB only a pipeline fits. Model.train runs it;
  afterwards every rank holds the whole trained network (Model.eval's loss = one process's).
"""
import json
import sys

import numpy as np
import torch
from torch.distributed.tensor import DTensor

import autopar
import autopar.dataset as ds
from autopar.communication import get_group_size, get_rank, init
from autopar.context import managed
from autopar.nn import Momentum
from autopar.train import Model

out = sys.argv[1]
SCENARIO = sys.argv[2] if len(sys.argv) > 2 else "layouts"
WIDTH, PER_RANK, DEPTH, LIMIT = {"layouts": (512, 8, 4, "7.5MB"), "zero": (256, 2048, 4, "18.3MB"),
                                 "pipeline": (256, 512, 8, "6MB")}[SCENARIO]
autopar.set_auto_parallel_context(parallel_mode="auto_parallel", gradients_mean=True, max_device_memory=LIMIT,
                                  strategy_ckpt_save_file=out + ".strategy.json")
init()
rank, n = get_rank(), get_group_size()


def make():
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


rng = np.random.default_rng(0)
X = rng.standard_normal((3 * PER_RANK * n, WIDTH)).astype(np.float32)
Y = rng.standard_normal((3 * PER_RANK * n, WIDTH)).astype(np.float32)
net = make()
data = ds.NumpySlicesDataset({"x": X, "y": Y}, shuffle=False, num_shards=n, shard_id=rank).batch(PER_RANK)
model = Model(net, torch.nn.MSELoss(), Momentum(net.parameters(), 0.01, 0.9))
model.train(1, data.take(3))

ref = make()
opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
with managed():  # the reference is one process: its first call must not parallelize (and plan) it
    for step in range(3):
        idx = np.arange(step * PER_RANK * n, (step + 1) * PER_RANK * n)  # the ranks' interleaved shards
        loss = torch.nn.functional.mse_loss(ref(torch.tensor(X[idx])), torch.tensor(Y[idx]))
        opt.zero_grad()
        loss.backward()
        opt.step()
full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in net.state_dict().items()}
diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
eval_diff = None
if SCENARIO == "pipeline":  # the same evaluation data on every rank: the trained network's loss = one process's
    got = Model(net, torch.nn.MSELoss(), metrics={"loss"}).eval([(torch.tensor(X[:64]), torch.tensor(Y[:64]))])
    with managed():
        want = torch.nn.functional.mse_loss(ref(torch.tensor(X[:64])), torch.tensor(Y[:64])).item()
    eval_diff = abs(got["loss"] - want)
local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in net.parameters())
sharded = [k for k, p in net.named_parameters() if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)]
json.dump({"diff": diff, "eval_diff": eval_diff, "local_params": local, "full_params": sum(p.numel() for p in ref.parameters()),
           "sharded": sharded}, open(f"{out}.{rank}", "w"))
print(f"RANK {rank} diff {diff} local {local} sharded {sharded}", flush=True)
