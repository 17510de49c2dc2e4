"""Worker: a conv net with BatchNorm and no strategy trains in SEMI_AUTO_PARALLEL exactly as in DATA_PARALLEL.

argv: OUT. Both runs start from the same weights and see the same sharded data; rank 0 writes the largest
parameter difference after 4 steps (expected exactly 0: an unannotated network *is* data parallel).
"""
import json
import sys

import numpy as np
import torch

import autopar
import autopar.dataset as ds
from autopar.communication import get_group_size, get_rank, init
from autopar.nn import Momentum, SoftmaxCrossEntropyExpand
from autopar.train import Model

init()
rank, n = get_rank(), get_group_size()
rng = np.random.default_rng(0)
X = rng.standard_normal((64, 3, 8, 8)).astype(np.float32)
Y = rng.integers(0, 4, 64).astype(np.int32)


def train(mode):
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(parallel_mode=mode, gradients_mean=True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    data = ds.NumpySlicesDataset({"x": X, "y": Y}, shuffle=False, num_shards=n, shard_id=rank).batch(8)
    Model(net, SoftmaxCrossEntropyExpand(sparse=True), Momentum(net.parameters(), 0.1, 0.9)).train(1, data)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


dp = train("data_parallel")
semi = train("semi_auto_parallel")
diff = max((dp[k].float() - semi[k].float()).abs().max().item() for k in dp)
moved = max((dp[k].float() - v.float()).abs().max().item() for k, v in train("stand_alone").items())
print(f"RANK {rank} DIFF {diff} VS_STANDALONE {moved}", flush=True)
if rank == 0:
    json.dump({"diff": diff, "vs_standalone": moved}, open(sys.argv[1], "w"))
