"""Worker: a small convolutional net whose 3x3 kernels see 2x2 and 1x1 maps, 3 Momentum steps under DATA_PARALLEL.

argv: OUT MEAN(0|1) PENALTY(0|1). PENALTY adds an L2 term over the conv weights to the loss, which gives every tap
a gradient. Rank 0 saves the parameters and how many gradient elements went into all-reduces per step.
"""
import json
import sys

import numpy as np
import torch
import torch.distributed as dist

import autopar
import autopar.dataset as ds
from autopar.nn import Momentum
from autopar.train import Model

out, mean, penalty = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
autopar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=mean, parameter_broadcast=True)
autopar.init()
sent = [0]
all_reduce = dist.all_reduce


def counting_all_reduce(tensor, *args, **kwargs):
    if kwargs.get("async_op"):  # the gradient all-reduces (the mask agreement is synchronous)
        sent[0] += tensor.numel()
    return all_reduce(tensor, *args, **kwargs)


dist.all_reduce = counting_all_reduce


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(4, 8, 3, stride=2, padding=1)  # 2x2 -> 1x1: 4 of 9 taps see the input
        self.b = torch.nn.Conv2d(8, 8, 3, padding=1)  # 1x1 -> 1x1: the centre tap only
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.b(torch.relu(self.a(x)))).flatten(1))


class Loss(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = [net]  # not a submodule: DDP wraps the network only

    def forward(self, logits, labels):
        loss = torch.nn.functional.cross_entropy(logits, labels)
        if penalty:
            loss = loss + 1e-2 * sum(m.weight.square().sum() for m in (self.net[0].a, self.net[0].b))
        return loss


rng = np.random.default_rng(0)
x = rng.standard_normal((48, 4, 2, 2)).astype(np.float32)
y = rng.integers(0, 5, 48).astype(np.int64)
data = ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False, num_shards=autopar.get_group_size(),
                             shard_id=autopar.get_rank()).batch(8, drop_remainder=True)
torch.manual_seed(0)
net = Net()
Model(net, Loss(net), Momentum(net.parameters(), 0.1, 0.9)).train(1, data, dataset_sink_mode=True, sink_size=3)
if autopar.get_rank() == 0:
    torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, out)
    with open(out + ".json", "w") as f:
        json.dump({"sent_per_step": sent[0] / 3}, f)
