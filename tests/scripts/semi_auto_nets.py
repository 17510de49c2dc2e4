"""Worker: the seeds' SemiAutoParallelNet and HybridParallelNet (imports changed only) against the unsharded math.

argv: OUT_JSON CASES_JSON where CASES is a list of ["semi", strategy] / ["hybrid", null] / ["hybrid_model", null] /
["conflict", null] / ["ops", null] / ["strategy_file", null] / ["constant_id", null]. For each case every rank
compares forward outputs, parameter gradients and parameters after 3 SGD steps with plain torch on the whole batch
in the same process; results (largest differences, the rank's parameter size, error messages) go to
OUT_JSON.<rank>.
"""
import json
import sys

import numpy as np
import torch
from torch.distributed.tensor import DTensor

import autopar as ms
import autopar.dataset as ds
import autopar.nn as nn
import autopar.ops as ops
from autopar import Parameter, Tensor
from autopar.communication import get_group_size, get_rank, init
from autopar.errors import StrategyError
from autopar.parallel.api import parallelize
from autopar.train import Model


class SemiAutoParallelNet(nn.Cell):
    def __init__(self, weight_init, strategy):
        super(SemiAutoParallelNet, self).__init__()
        self.weight = Parameter(Tensor(weight_init))
        self.fc = ops.MatMul().shard(strategy)
        self.reduce = ops.ReduceSum()

    def construct(self, x):
        x = self.fc(x, self.weight)
        x = self.reduce(x, -1)
        return x


class HybridParallelNet(nn.Cell):
    def __init__(self, weight_init):
        super(HybridParallelNet, self).__init__()
        self.weight = Parameter(Tensor(weight_init), layerwise_parallel=True)
        self.fc = ops.MatMul()
        self.reduce = ops.ReduceSum()
        self.allreduce = ops.AllReduce(op='sum')

    def construct(self, x):
        x = self.fc(x, self.weight)
        x = self.reduce(x, -1)
        x = self.allreduce(x)
        return x


class SharedWeightNet(nn.Cell):
    """One parameter, two operators, two strategies: MindSpore's "shared parameter" error."""

    def __init__(self, weight_init):
        super().__init__()
        self.weight = Parameter(Tensor(weight_init))
        self.fc1 = ops.MatMul().shard(((1, 1), (1, 2)))
        self.fc2 = ops.MatMul().shard(((2, 1), (1, 1)))

    def construct(self, x):
        return self.fc2(x, self.weight) + self.fc1(x, self.weight)


class OpsNet(nn.Cell):
    """Most shardable operators in a row, with strategies that force every kind of redistribution."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.w = Parameter(torch.randn(16, 8, generator=g) * 0.3)
        self.b = Parameter(torch.randn(8, generator=g) * 0.1)
        self.mm = ops.MatMul().shard(((2, 1), (1, 1)))
        self.bias = ops.BiasAdd().shard(((2, 1), (1,)))
        self.gelu = ops.GeLU().shard(((1, 2),))
        self.mul = ops.Mul().shard(((2, 1), (2, 1)))
        self.softmax = ops.Softmax().shard(((2, 1),))
        self.add = ops.Add()
        self.log = ops.Log()
        self.transpose = ops.Transpose().shard(((1, 2),))
        self.max = ops.ReduceMax(keep_dims=True).shard(((1, 2),))
        self.sub = ops.Sub().shard(((1, 2), (1, 1)))
        self.exp = ops.Exp()
        self.reshape = ops.Reshape()
        self.transpose3 = ops.Transpose()
        self.bmm = ops.BatchMatMul().shard(((2, 1, 1), (2, 1, 1)))
        self.mean = ops.ReduceMean().shard(((2, 1, 1),))
        self.onehot = ops.OneHot().shard(((1, 2), (), ()))
        self.mul2 = ops.Mul().shard(((1, 2), (1, 2)))
        self.sum = ops.ReduceSum().shard(((1, 2),))
        self.relu = ops.ReLU()
        self.div = ops.RealDiv().shard(((2,), (2,)))

    def construct(self, x, labels):
        h = self.bias(self.mm(x, self.w), self.b)
        h = self.mul(self.gelu(h), h)
        soft = self.softmax(h)
        r = self.transpose(self.log(self.add(soft, Tensor(0.1))), (1, 0))
        e = self.exp(self.sub(r, self.max(r, -1)))
        t = self.reshape(e, (8, 2, 4))
        bm = self.mean(self.bmm(t, self.transpose3(t, (0, 2, 1))), (1, 2))
        picked = self.sum(self.mul2(self.relu(h), self.onehot(labels, 8, Tensor(1.0), Tensor(0.0))), -1)
        return self.div(bm + picked, picked + 2.0)


class SquaredError(nn.Cell):
    def construct(self, out, y):
        return ((out - y) ** 2).mean()


out_path, cases = sys.argv[1], json.loads(sys.argv[2])
init()
rank, n = get_rank(), get_group_size()
rng = np.random.default_rng(0)
batch = 8
W = (rng.standard_normal((512, 128)) * 0.02).astype(np.float32)
X = (rng.standard_normal((3, batch, 512)) * 0.1).astype(np.float32)
Y = rng.standard_normal((3, batch)).astype(np.float32)
cols = 128 // n
results = {}


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def unshard_columns(t):  # the layerwise weight's column slices, gathered
    parts = [torch.empty_like(t) for _ in range(n)]
    torch.distributed.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=1)


def reference_steps():
    """Plain torch on the whole batch: outputs, gradients and weights of 3 SGD steps."""
    w = torch.tensor(W, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    outs, grads, weights = [], [], []
    for step in range(3):
        x, y = torch.tensor(X[step]), torch.tensor(Y[step])
        out = (x @ w).sum(-1)
        ((out - y) ** 2).mean().backward()
        outs.append(out.detach().clone())
        grads.append(w.grad.clone())
        opt.step()
        opt.zero_grad()
        weights.append(w.detach().clone())
    return outs, grads, weights


REF = reference_steps()


def run_direct(kind, strategy):
    """``semi_bare``: the same loop with no autopar call in it (the first forward parallelizes the network)."""
    bare = kind == "semi_bare"
    kind = "semi" if bare else kind
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel" if kind == "semi" else "hybrid_parallel",
                                 gradients_mean=True)
    if kind == "semi":
        net = SemiAutoParallelNet(W, tuple(tuple(s) for s in strategy))
        rows = slice(rank * batch // n, (rank + 1) * batch // n)  # each rank loads its slice of the batch
        gather = full
    else:
        net = HybridParallelNet(W[:, rank * cols:(rank + 1) * cols])  # this rank's columns, as the seed's 128/2
        rows = slice(0, batch)  # the explicit all-reduce needs the same samples on every rank
        gather = unshard_columns
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if kind == "semi" and not bare:
        parallelize(net, opt)
    worst = {"out": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(3):
        x, y = torch.tensor(X[step]), torch.tensor(Y[step])
        out = net(x[rows])
        ((out - y[rows]) ** 2).mean().backward()
        # hybrid: the layerwise gradient is divided by the world size (gradients_mean) by its hook
        worst["out"] = max(worst["out"], (out - REF[0][step][rows]).abs().max().item())
        worst["grad"] = max(worst["grad"], (gather(net.weight.grad) - REF[1][step]).abs().max().item())
        opt.step()
        opt.zero_grad()
        worst["param"] = max(worst["param"], (gather(net.weight.detach()) - REF[2][step]).abs().max().item())
    w = net.weight
    worst["local_numel"] = (w.to_local() if isinstance(w, DTensor) else w).numel()
    worst["full_numel"] = W.size
    return worst


def run_hybrid_model():
    """HybridParallelNet through Model.train (same data on every rank, gradients_mean=True)."""
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode="hybrid_parallel", gradients_mean=True)
    net = HybridParallelNet(W[:, rank * cols:(rank + 1) * cols])
    data = ds.NumpySlicesDataset({"x": X.reshape(-1, 512), "y": Y.reshape(-1)}, shuffle=False).batch(batch)
    Model(net, SquaredError(), nn.SGD(net.parameters(), 0.1)).train(1, data)
    return {"param": (unshard_columns(net.weight.detach()) - REF[2][-1]).abs().max().item()}


def run_conflict():
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    net = SharedWeightNet(W[:, :128])
    try:
        net(torch.tensor(X[0][rank * batch // n:(rank + 1) * batch // n]))
    except StrategyError as exc:
        return {"error": str(exc)}
    return {"error": None}


def run_ops():
    """Every operator of OpsNet sharded (full batch on every rank) vs the same Cell computed locally."""
    ms.reset_auto_parallel_context()
    # full_batch: every rank feeds the whole batch and gets the whole output back; the loss on it is one process's,
    # and so are the gradients (gradients_mean combines different data, here there is one)
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=False, full_batch=True)
    x = torch.tensor(X[0][:, :16] * 10)
    labels = torch.tensor(np.arange(8) % 8, dtype=torch.int32)
    net, ref = OpsNet(), OpsNet()
    out = net(x, labels)
    out.sum().backward()
    ref_out = ref.forward(x, labels)  # forward() bypasses the parallel runtime: plain local computation
    ref_out.sum().backward()
    return {"out": (out - ref_out).abs().max().item(),
            "grad": max((full(net.w.grad) - ref.w.grad).abs().max().item(),
                        (full(net.b.grad) - ref.b.grad).abs().max().item())}


class ConstantNet(nn.Cell):
    """A sharded parameter, then a constant the network does not own (held in a list: not a parameter)."""

    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(np.arange(16, dtype=np.float32)))
        self.mul = ops.Mul().shard(((2,), (2,)))
        self.add = ops.Add()
        self.constant = [Tensor(0.0)]

    def construct(self, x):
        return self.add(self.mul(x, self.w), self.constant[0])


def run_constant_reusing_an_id(attempts: int = 8):
    """The original of a converted parameter is freed; CPython soon gives a new tensor its id. Such a constant
    must stay a constant (it was taken for the parameter: a flaky shape error, 'size 4 vs 16').

    Whether a new tensor lands on the freed address is the allocator's chance, and each rank's own history (rank 0
    alone prints the parallel mode) changes it: a rank that did not land there tries again with a new network, and
    the ranks agree before the forward they run together (one rank skipping it left the other in a collective)."""
    import torch.distributed as dist

    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", full_batch=True)
    x = torch.ones(16)
    for _ in range(attempts):
        net = ConstantNet()
        original = [net.w]  # held until the conversion's own new objects exist, so that its address is free after
        freed = id(original[0])
        net(x)  # converts w
        original.clear()  # nothing else holds the original any more
        made = []  # kept alive, so that new tensors walk through the allocator's free slots until one is the freed one
        constant = None
        for _ in range(200000):
            candidate = torch.tensor(0.5)
            if id(candidate) == freed:
                constant = candidate
                break
            made.append(candidate)
        made.clear()
        everywhere = torch.tensor([constant is not None], dtype=torch.int32)
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
        if everywhere.item():
            break
    else:
        return {"reused": False}
    net.constant[0] = constant
    out = net(x)  # full_batch: the whole output on every rank
    return {"reused": True, "out": (out - (torch.arange(16.0) + 0.5)).abs().max().item()}


def run_strategy_file():
    """strategy_ckpt_load_file: a parameter layout that disagrees with the network's strategy is an error."""
    path = f"{out_path}.strategy.json"
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", strategy_ckpt_save_file=path)
    SemiAutoParallelNet(W, ((1, 1), (1, 2)))(torch.tensor(X[0][:batch // n]))
    torch.distributed.barrier()
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", strategy_ckpt_load_file=path)
    SemiAutoParallelNet(W, ((1, 1), (1, 2)))(torch.tensor(X[0][:batch // n]))  # agrees: fine
    try:
        SemiAutoParallelNet(W, ((2, 1), (1, 1)))(torch.tensor(X[0][:batch // n]))
        error = None
    except StrategyError as exc:
        error = str(exc)
    # an operator strategy of the file that does not fit this network's inputs (8 columns then, 7 now)
    class Squares(torch.nn.Module):
        def __init__(self, strategy=None):
            super().__init__()
            self.mul = ops.Mul() if strategy is None else ops.Mul().shard(strategy)
            self.w = Parameter(torch.ones(1))

        def forward(self, x):
            return self.mul(x, x) * self.w

    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", strategy_ckpt_save_file=path + ".ops")
    Squares(((1, 2), (1, 2)))(torch.ones(4, 8))
    torch.distributed.barrier()
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", strategy_ckpt_load_file=path + ".ops")
    try:
        Squares()(torch.ones(4, 7))
        op_error = None
    except StrategyError as exc:
        op_error = str(exc)
    ms.reset_auto_parallel_context()
    return {"error": error, "op_error": op_error, "path": path}


def run_dataset_strategy():
    """dataset_strategy ((2, 1),) on 4 ranks: the batch is split in 2 only; each rank loads the slice
    dataset_shard() names, the network still matches the whole-batch computation."""
    from autopar.parallel.tensor.inputs import dataset_shard

    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True, dataset_strategy=((2, 1),))
    parts, shard = dataset_shard((2, 1))
    net = SemiAutoParallelNet(W, ((1, 1), (1, 2)))
    x = torch.tensor(X[0])
    out = net(x[shard * batch // parts:(shard + 1) * batch // parts])
    rows = slice(rank * batch // n, (rank + 1) * batch // n)  # the output is batch-split over every device
    return {"out": (out - REF[0][0][rows]).abs().max().item(), "shard": [parts, shard]}


for kind, strategy in cases:
    key = kind + ("" if strategy is None else json.dumps(strategy))
    if kind in ("semi", "semi_bare", "hybrid"):
        results[key] = run_direct(kind, strategy)
    elif kind == "hybrid_model":
        results[key] = run_hybrid_model()
    elif kind == "ops":
        results[key] = run_ops()
    elif kind == "dataset_strategy":
        results[key] = run_dataset_strategy()
    elif kind == "strategy_file":
        results[key] = run_strategy_file()
    elif kind == "constant_id":
        results[key] = run_constant_reusing_an_id()
    else:
        results[key] = run_conflict()
    print(f"RANK {rank} {key} {results[key]}", flush=True)
json.dump(results, open(f"{out_path}.{rank}", "w"))
