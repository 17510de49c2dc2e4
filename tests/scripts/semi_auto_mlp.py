"""Worker: a 2-layer MLP of plain ``nn.Linear`` in the Megatron pattern (first weight split by columns, second by
rows) via ``autopar.shard``, trained with ``Model`` in SEMI_AUTO_PARALLEL; compared with plain torch on the whole
batch: loss per step, parameters after 3 steps, and the trained model's predictions.

argv: OUT_JSON. Writes the largest differences and the per-rank parameter sizes to OUT_JSON.<rank>.
"""
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import autopar
import autopar.dataset as ds
from autopar.communication import get_group_size, get_rank, init
from autopar.nn import Momentum, SoftmaxCrossEntropyExpand
from autopar.train import Callback, Model

out_path = sys.argv[1]
autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True,
                                  strategy_ckpt_save_file=out_path + ".strategy.json")
init()
rank, n = get_rank(), get_group_size()


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(32, 6)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def make():
    torch.manual_seed(0)
    return MLP()


rng = np.random.default_rng(0)
X = rng.standard_normal((48, 16)).astype(np.float32)
Y = rng.integers(0, 6, 48).astype(np.int32)
batch = 8  # per rank; the global batch is 8 * n

net = make()
autopar.shard(net.fc1, ((1, 1), (n, 1)))  # column: fc1's output features split
autopar.shard(net.fc2, ((1, n), (1, n)))  # row: fc2's input features split, partial sums all-reduced
losses = []


class Record(Callback):
    def on_train_step_end(self, run_context):
        losses.append(float(run_context.original_args().net_outputs))


data = ds.NumpySlicesDataset({"x": X, "y": Y}, shuffle=False, num_shards=n, shard_id=rank).batch(batch)
model = Model(net, SoftmaxCrossEntropyExpand(sparse=True), Momentum(net.parameters(), 0.1, 0.9))
model.train(1, data.take(3), callbacks=[Record()])

# reference: one process, global batches (rank r's shard interleaves: sample i goes to rank i % n)
ref = make()
opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
ref_losses = []
for step in range(3):
    idx = np.arange(step * batch * n, (step + 1) * batch * n)
    loss = F.cross_entropy(ref(torch.tensor(X[idx])), torch.tensor(Y[idx]).long())
    ref_losses.append(loss.item())
    opt.zero_grad()
    loss.backward()
    opt.step()

full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in net.state_dict().items()}
param_diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
pred = model.predict(torch.tensor(X[rank::n][:batch]))  # this rank's share of a batch -> its rows of the logits
ref_pred = ref(torch.tensor(X[rank::n][:batch]))
sizes = {k: (p.to_local() if isinstance(p, DTensor) else p).numel() for k, p in net.named_parameters()}
result = {"loss_rank0_vs_ref": abs(losses[-1] - ref_losses[-1]) if rank == 0 else 0.0, "param": param_diff,
          "pred": (pred - ref_pred).abs().max().item(), "local_sizes": sizes,
          "placements": {k: str(p.placements) for k, p in net.named_parameters() if isinstance(p, DTensor)}}
json.dump(result, open(f"{out_path}.{rank}", "w"))
print(f"RANK {rank} RESULT {result}", flush=True)
