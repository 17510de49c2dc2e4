"""Worker: MindSpore's gradient-accumulation sample cells (``ms_samples/cell_wrapper.py``: the r1.7 file, imports
swapped) driven as the sample's ``Model_ACCU`` drives them -- ``add_flags_recursive(accumulation=True)`` for k-1
mini-steps, then ``accumulation=False`` for the updating one -- in DATA_PARALLEL, SEMI_AUTO_PARALLEL and
AUTO_PARALLEL with ``grad_accumulation_step=k``, ``gradients_mean=True``.

Each case checks that the parameters do not move for k-1 mini-steps and that the k-th update equals one process
taking one Momentum step on the sum of the k micro-batches' gradients (each micro-batch the ranks' batches joined),
for two rounds of k; and counts data parallel's gradient reductions in the accumulating and the updating steps
(MindSpore reduces the sum once). argv: OUT_PREFIX CASES_JSON; writes {case: {"still": bool, "update": max
difference, "reduced": counts}} to OUT_PREFIX.<rank>.
"""
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "ms_samples"))

from cell_wrapper import TrainAccuStepsCell, TrainAccuStepsWithLossScaleCell, VirtualDatasetCell  # noqa: E402

import autopar as ms  # noqa: E402
from autopar import nn, ops  # noqa: E402
from autopar.communication import get_group_size, get_rank, init  # noqa: E402
from autopar.parallel.grads.buckets import BucketReducer  # noqa: E402

out_prefix, cases = sys.argv[1], json.loads(sys.argv[2])
init()
rank, world = get_rank(), get_group_size()
K, ROUNDS, BATCH = 3, 2, 4  # per-rank micro-batch BATCH; the global one is world * BATCH


class Net(nn.Cell):
    def __init__(self, shard: bool):
        super().__init__()
        self.w1 = ms.Parameter(torch.randn(8, 16) * 0.3, "w1")
        self.w2 = ms.Parameter(torch.randn(16, 4) * 0.3, "w2")
        self.matmul1, self.relu, self.matmul2 = ops.MatMul(), ops.ReLU(), ops.MatMul()
        if shard:
            self.matmul1.shard(((1, 1), (1, world)))
            self.relu.shard(((1, world),))
            self.matmul2.shard(((1, world), (world, 1)))

    def construct(self, x):
        return self.matmul2(self.relu(self.matmul1(x, self.w1)), self.w2)


def micro_batches() -> list:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(world * BATCH, 8, generator=g), torch.randn(world * BATCH, 4, generator=g))
            for _ in range(K * ROUNDS)]


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def reference(init_state: dict) -> list:
    """One process: after each round, one Momentum step on the sum of the round's k global micro-batch gradients."""
    net = Net(False)
    with torch.no_grad():
        for k, p in net.named_parameters():
            p.copy_(init_state[k])
    opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    states, data = [], micro_batches()
    for r in range(ROUNDS):
        opt.zero_grad()
        for x, y in data[r * K:(r + 1) * K]:
            torch.nn.functional.mse_loss(net(x), y).backward()  # .grad sums the micro-batches
        opt.step()
        states.append({k: p.detach().clone() for k, p in net.named_parameters()})
    return states


REDUCTIONS = [0]  # data parallel's gradient reductions (each micro-batch's, or a returned sum's)


def _counting(method):
    def counted(*args, **kwargs):
        REDUCTIONS[0] += 1
        return method(*args, **kwargs)
    return counted


BucketReducer._complete_one = _counting(BucketReducer._complete_one)
BucketReducer.complete_returned = _counting(BucketReducer.complete_returned)


def run(mode: str, loss_scale: bool) -> dict:
    """``mode``: a parallel mode; ``auto_parallel/sp``: AUTO's sharding propagation from the strategies (its
    weights then train as DTensor slices, where the planner's own choice for this net is data parallel)."""
    mode, _, propagate = mode.partition("/")
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode=mode, gradients_mean=True, grad_accumulation_step=K,
                                 **({"search_mode": "sharding_propagation"} if propagate else {}))
    torch.manual_seed(3)
    net = Net(mode == "semi_auto_parallel" or bool(propagate))
    init_state = {k: p.detach().clone() for k, p in net.named_parameters()}
    want = reference(init_state)
    opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    net_with_loss = VirtualDatasetCell(nn.WithLossCell(net, nn.MSELoss()))
    if loss_scale:
        wrap = TrainAccuStepsWithLossScaleCell(net_with_loss, opt, nn.FixedLossScaleUpdateCell(1.0))
    else:
        wrap = TrainAccuStepsCell(net_with_loss, opt)
    still, worst, before = True, 0.0, init_state
    reduced = {"accumulating": 0, "updating": 0}
    for step, (x, y) in enumerate(micro_batches()):
        last = step % K == K - 1
        wrap.add_flags_recursive(accumulation=not last)
        REDUCTIONS[0] = 0
        wrap(x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH])
        reduced["updating" if last else "accumulating"] += REDUCTIONS[0]
        now = {k: full(p) for k, p in net.named_parameters()}
        if last:
            worst = max(worst, max(float((now[k] - want[step // K][k]).abs().max()) for k in now))
            before = now
        else:
            still = still and all(torch.equal(now[k], before[k]) for k in now)
    kinds = sorted({type(p).__name__ for p in net.parameters()})
    return {"still": still, "update": worst, "kinds": kinds, "reduced": reduced}


results = {}
for case in cases:
    mode, _, scaled = case.partition("+")
    try:
        results[case] = run(mode, bool(scaled))
    except Exception as exc:  # noqa: BLE001 - reported per case
        results[case] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
json.dump(results, open(f"{out_prefix}.{rank}", "w"))
