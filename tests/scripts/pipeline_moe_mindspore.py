"""Worker: MindSpore's mixture of experts inside pipeline stages, through MindSpore's door, equals one process on the
global batch in float64.

argv: OUT_PREFIX. 4 ranks: ``pipeline_stages=2``, so 2 data-parallel replicas a stage. The network, as a MindSpore
script writes it: two blocks, each a Dense then ``nn.transformer.MoE(moe_config=MoEConfig(expert_num=4,
num_experts_chosen=2, capacity_factor=4.0), parallel_config=MoEParallelConfig(expert_parallel=E))`` with a residual,
the cells marked ``pipeline_stage``; ``Model(nn.PipelineCell(nn.WithLossCell(net, loss), 2), optimizer=AdamW)``. Cases:
``whole`` (E = 1), ``spread`` (E = 2, the stage's replicas: each rank 2 of the 4 experts), ``spread_zero`` (and
``enable_parallel_optimizer``: ZeRO-1 over the replicas beside them), ``other`` (E = 4, not a stage's replicas:
said, the experts whole). Each: the per-step losses and every parameter after 3 steps against one process (the
micro-batches' losses summed, as MindSpore's PipelineCell), the warnings said. Writes {case: result} to
OUT_PREFIX.<rank>.
"""
import json
import sys
import warnings

import torch
from torch.distributed.tensor import DTensor

import autopar
from autopar import nn
from autopar.communication import get_group_size, get_rank, init
from autopar.nn.transformer import MoE, MoEConfig, MoEParallelConfig
from autopar.parallel.pipeline.runner import pipeline_of
from autopar.train import Model
from autopar.train.callbacks import Callback

out_prefix = sys.argv[1]
torch.set_default_dtype(torch.float64)
init()
rank, n = get_rank(), get_group_size()
MICRO = 2


class Block(nn.Cell):
    def __init__(self, ep: int):
        super().__init__()
        self.dense = torch.nn.Linear(16, 16)
        # capacity 4: no assignment dropped (the capacity counts a micro-batch's tokens, as each call does)
        self.moe = MoE(16, 24, hidden_act="gelu", param_init_type=torch.float64,
                       moe_config=MoEConfig(expert_num=4, capacity_factor=4.0, num_experts_chosen=2),
                       parallel_config=MoEParallelConfig(expert_parallel=ep))

    def construct(self, x):
        out, _ = self.moe(torch.relu(self.dense(x)))
        return x + out


class Net(nn.Cell):
    def __init__(self, ep: int = 1):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.b0, self.b1, self.head = torch.nn.Linear(8, 16), Block(ep), Block(ep), torch.nn.Linear(16, 5)

    def construct(self, x):
        return self.head(self.b1(self.b0(self.embed(x))))


g = torch.Generator().manual_seed(1)
X, Y = torch.randn(3, 8, 6, 8, generator=g), torch.randint(0, 5, (3, 8, 6), generator=g)


def loss_fn(out, y):
    return torch.nn.functional.cross_entropy(out.reshape(-1, 5), y.reshape(-1))


def reference():
    autopar.reset_auto_parallel_context()
    net, losses = Net(), []
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in range(len(X)):
        loss = loss_fn(net(X[step]), Y[step]) * MICRO  # PipelineCell sums its micro-batches' losses
        losses.append(float(loss))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses, {k: p.detach() for k, p in net.named_parameters()}


class Losses(Callback):
    def __init__(self):
        self.values = []

    def step_end(self, run_context):
        self.values.append(float(run_context.original_args().net_outputs))


REF_LOSSES, REF = reference()
CASES = {"whole": (1, {}), "spread": (2, {}), "spread_zero": (2, {"enable_parallel_optimizer": True}),
         "other": (4, {})}
results = {}
for case, (ep, context) in CASES.items():
    try:
        autopar.reset_auto_parallel_context()
        autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True, pipeline_stages=2,
                                          **context)
        net = Net(ep)
        for name, stage in (("embed", 0), ("b0", 0), ("b1", 1), ("head", 1)):
            getattr(net, name).pipeline_stage = stage
        model = Model(nn.PipelineCell(nn.WithLossCell(net, loss_fn), MICRO),
                      optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2))
        replicas, cb = n // 2, Losses()
        rows = slice(rank % replicas * 8 // replicas, (rank % replicas + 1) * 8 // replicas)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.train(1, [(X[s, rows], Y[s, rows]) for s in range(len(X))], callbacks=[cb])
        runner = pipeline_of(net)
        experts = {k: list(p.to_local().shape) for k, p in runner.stage_module.named_parameters()
                   if getattr(p, "_autopar_spread", False)}
        runner.gather_parameters()
        whole = {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for k, p in net.named_parameters()}
        results[case] = {"param_diff": max(float((whole[k] - REF[k]).abs().max()) for k in REF),
                         "loss_diff": max(abs(a - b) for a, b in zip(cb.values, REF_LOSSES)), "ep": runner.ep,
                         "zero": runner.zero, "experts": experts, "sync": runner.gradient_sync,
                         "warnings": [str(w.message) for w in caught if "autopar" in str(w.message)]}
    except Exception as exc:  # noqa: BLE001 - recorded: the test names the case
        import traceback

        results[case] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "trace": traceback.format_exc()[-1500:]}
json.dump(results, open(f"{out_prefix}.{rank}", "w"), indent=1)
print(f"RANK {rank} DONE", flush=True)
