"""Worker: the MindSpore door behaves as MindSpore -- each case against one process on the same global batch.

argv: OUT_PREFIX WORKDIR CASES_JSON. Cases (2 or 4 ranks):

- ``propagation``: AUTO_PARALLEL with ``search_mode="sharding_propagation"`` and a strategy on the first MatMul only
  (MindSpore's quick start, its FFN): the neighbours take strategies that consume the first one's layout (the second
  MatMul's input split as the first one's output: ``((2, n/2), (n/2, 1))``), trained equal to one process;
- ``accumulation``: ``Model(nn.GradAccumulationCell(nn.WithLossCell(net, loss), 4))`` sums the micro-batches' losses
  (loss and gradients 4 x the batch mean's, as MindSpore), each micro-batch's backward on its own;
- ``value_and_grad_zero``: ``value_and_grad`` with ``enable_parallel_optimizer`` (MindSpore's optimizer-parallel
  sample): gradients through FSDP2's reduce-scatter, trained equal to one process;
- ``full_batch``: ``full_batch=True`` in a plain loop: every rank feeds the whole batch and gets the whole output, a
  loss computed outside the network equals one process, and so do the parameters after training;
- ``inference``: MindSpore's distributed inference -- train sliced on this world with a strategy, writing the
  strategy file (every rank, in a directory of its own) and sliced checkpoints; then a network built *without*
  strategies loads the strategy file (its operator strategies), ``infer_predict_layout`` and
  ``load_distributed_checkpoint``, and predicts the one-process result. With ``INFER_WORLD`` set, only the
  prediction part runs, on a job of another size, from WORKDIR's files.

Writes {case: result} to OUT_PREFIX.<rank>.
"""
import json
import os
import sys
import traceback
from pathlib import Path

import numpy as np
import torch

import autopar as ms
from autopar import nn, ops
from autopar.communication import get_group_size, get_rank, init
from autopar.train import Model

out_prefix, workdir, cases = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
init()
rank, n = get_rank(), get_group_size()
rng = np.random.default_rng(0)
STEPS, GLOBAL = 3, 16
X = torch.tensor(rng.standard_normal((STEPS, GLOBAL, 24)).astype(np.float32))
Y = torch.tensor(rng.integers(0, 6, (STEPS, GLOBAL)))


def local(step):
    rows = slice(rank * GLOBAL // n, (rank + 1) * GLOBAL // n)
    return X[step][rows], Y[step][rows]


class Dense(nn.Cell):
    """The quick start's Dense: a MatMul and an Add, each an operator that can carry a strategy."""

    def __init__(self, cin, cout):
        super().__init__()
        torch.manual_seed(cin * 100 + cout)
        self.weight = ms.Parameter(torch.randn(cin, cout) * 0.1)
        self.bias = ms.Parameter(torch.zeros(cout))
        self.matmul, self.add = ops.MatMul(), ops.Add()

    def construct(self, x):
        return self.add(self.matmul(x, self.weight), self.bias)


class FFN(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense1, self.relu, self.dense2 = Dense(24, 16), ops.ReLU(), Dense(16, 6)

    def construct(self, x):
        return self.dense2(self.relu(self.dense1(x)))


def params(net) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in net.named_parameters()}


def worst(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


def reference(loss_scale: float = 1.0, momentum: float = 0.9) -> dict:
    ms.reset_auto_parallel_context()
    with ms.context.managed():
        net = FFN()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=momentum)
        for step in range(STEPS):
            loss = torch.nn.functional.cross_entropy(net(X[step]), Y[step]) * loss_scale
            opt.zero_grad()
            loss.backward()
            opt.step()
    return params(net)


def train_functionally(net) -> None:
    """MindSpore 2.x's loop: value_and_grad over the optimizer's parameters, then opt(grads)."""
    opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    loss_fn = nn.CrossEntropyLoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    for step in range(STEPS):
        _, grads = grad_fn(*local(step))
        opt(grads)


def case_propagation() -> dict:
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="sharding_propagation",
                                 gradients_mean=True)
    net = FFN()
    net.dense1.matmul.shard(((2, 1), (1, n // 2)))
    train_functionally(net)
    return {"param": worst(params(net), reference()), "matmul2": [list(s) for s in net.dense2.matmul.strategy or ()],
            "add1": [list(s) for s in net.dense1.add.strategy or ()]}


def case_accumulation() -> dict:
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
    net = FFN()
    cell = nn.GradAccumulationCell(nn.WithLossCell(net, nn.CrossEntropyLoss()), 4)
    losses = []

    class Record(ms.train.Callback):
        def on_train_step_end(self, run_context):
            losses.append(float(run_context.original_args().net_outputs))

    Model(cell, optimizer=nn.Momentum(net.trainable_params(), 0.1, 0.9)).train(1, [local(s) for s in range(STEPS)],
                                                                               callbacks=[Record()])
    return {"param": worst(params(net), reference(loss_scale=4.0)), "losses": losses}


def case_value_and_grad_zero() -> dict:
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", enable_parallel_optimizer=True,
                                 gradients_mean=True)
    net = FFN()
    net.dense1.matmul.shard(((2, 1), (1, n // 2)))
    train_functionally(net)
    plain = FFN()  # without strategies: ZeRO on FSDP2, the data-parallel path
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode="data_parallel", enable_parallel_optimizer=True, gradients_mean=True)
    train_functionally(plain)
    ref = reference()
    return {"param_layouts": worst(params(net), ref), "param_fsdp": worst(params(plain), ref)}


def case_full_batch() -> dict:
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", full_batch=True, gradients_mean=True)
    net = FFN()
    net.dense1.matmul.shard(((2, 1), (1, n // 2)))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    shapes = []
    for step in range(STEPS):
        out = net(X[step])  # the whole batch on every rank
        shapes.append(list(out.shape))
        loss = torch.nn.functional.cross_entropy(out, Y[step])  # a loss outside the network, on the whole batch
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"param": worst(params(net), reference()), "shapes": shapes}


def case_inference() -> dict:
    infer_world = int(os.environ.get("INFER_WORLD", "0"))
    strategy = workdir / f"device{rank}" / "train_strategy.json"  # the r1.x layout: a directory per rank
    if not infer_world:
        ms.reset_auto_parallel_context()
        ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True,
                                     strategy_ckpt_save_file=str(strategy))
        net = FFN()
        net.dense1.matmul.shard(((2, 1), (1, n // 2)))
        config = ms.CheckpointConfig(keep_checkpoint_max=1, integrated_save=False)
        ckpt = ms.ModelCheckpoint(prefix="parallel", directory=str(workdir / f"device{rank}" / "ckpt"), config=config)
        Model(net, nn.CrossEntropyLoss(), nn.Momentum(net.trainable_params(), 0.1, 0.9)).train(
            1, [local(s) for s in range(STEPS)], callbacks=[ckpt])
        if rank == 0:
            json.dump({"world": n}, open(workdir / "trained.json", "w"))
        torch.distributed.barrier()
    world = json.load(open(workdir / "trained.json"))["world"]
    files = [str(next((workdir / f"device{r}" / "ckpt").glob("parallel-*.ckpt"))) for r in range(world)]
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", full_batch=True,
                                 strategy_ckpt_load_file=str(workdir / "device0" / "train_strategy.json"))
    net = FFN()  # no strategies: the loaded file gives them
    model = Model(net)
    data = X[0]
    layout = model.infer_predict_layout(data)
    ms.load_distributed_checkpoint(net, files, layout)
    pred = model.predict(data)
    ref = reference()
    with ms.context.managed():
        one = FFN()
        one.load_state_dict(ref)
        ref_pred = one(data)
    return {"pred": (pred - ref_pred).abs().max().item(), "shape": list(pred.shape), "world": n,
            "trained_on": world, "strategy": [list(s) for s in net.dense1.matmul.strategy or ()],
            "strategy_files": sorted(str(p.relative_to(workdir)) for p in workdir.glob("device*/train_strategy.json"))}


results = {}
for case in cases:
    try:
        results[case] = globals()[f"case_{case}"]()
    except Exception as exc:  # noqa: BLE001 - recorded: the test names the case
        results[case] = {"error": f"{type(exc).__name__}: {str(exc)[:600]}", "trace": traceback.format_exc()[-2500:]}
json.dump(results, open(f"{out_prefix}.{rank}", "w"), indent=1)
print(f"RANK {rank} DONE", flush=True)
