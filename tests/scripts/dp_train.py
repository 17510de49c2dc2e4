"""Worker: a few Momentum steps of a BatchNorm-free MLP under DATA_PARALLEL; rank 0 saves the parameters.

argv: OUT MEAN(0|1) ACCUM BATCH. Data: 64 fixed samples, NumpySlicesDataset(shuffle=False) sharded by rank, so
rank r's micro-batch m holds samples r, r+N, ... and the union over ranks of one optimizer step is exactly the
next ``N * ACCUM * BATCH`` samples in order -- what one process with that batch size sees.
"""
import sys

import torch

import autopar
import autopar.dataset as ds
from autopar.comm.host_memory import HostGroup
from autopar.nn import Momentum
from autopar.parallel.grads.transports import GroupTransport
from autopar.train import Model

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dp_common import make_data, make_net  # noqa: E402

out, mean, accum, batch = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
autopar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=mean, parameter_broadcast=True)
autopar.init()
calls = [0]
original_reduce = GroupTransport.reduce


def counting_reduce(self, *args, **kwargs):
    calls[0] += 1
    return original_reduce(self, *args, **kwargs)


GroupTransport.reduce = counting_reduce
host_calls = [0]
original_range = HostGroup.all_reduce_range


def counting_range(self, *args, **kwargs):
    host_calls[0] += 1
    return original_range(self, *args, **kwargs)


HostGroup.all_reduce_range = counting_range
x, y = make_data()
data = ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False, num_shards=autopar.get_group_size(),
                             shard_id=autopar.get_rank()).batch(batch, drop_remainder=True)
torch.manual_seed(autopar.get_rank())  # different init per rank: parameter_broadcast must fix it
net = make_net()
model = Model(net, torch.nn.CrossEntropyLoss(), Momentum(net.parameters(), 0.1, 0.9), grad_accumulation_steps=accum)
model.train(1, data.take(3 * accum))
print(f"RANK {autopar.get_rank()} GROUP_SUMS {calls[0]} SHARED_MEMORY_SUMS {host_calls[0]}", flush=True)
if autopar.get_rank() == 0:
    torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, out)
