"""Benchmark workload: a wide MLP (4 x Linear(H, H) + ReLU) trained with Model, as DATA_PARALLEL or as Megatron
column/row tensor parallel (SEMI_AUTO_PARALLEL via autopar.shard). One JSON line per rank."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import autopar  # noqa: E402
import autopar.dataset as ds  # noqa: E402
from autopar.communication import get_group_size, get_rank, init  # noqa: E402
from autopar.nn import Momentum  # noqa: E402
from autopar.train import Callback, Model  # noqa: E402

from common import StepClock  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("dp", "tp"), required=True)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    mode = "data_parallel" if args.mode == "dp" else "semi_auto_parallel"
    autopar.set_auto_parallel_context(parallel_mode=mode, gradients_mean=True)
    init()
    n, rank = get_group_size(), get_rank()
    torch.manual_seed(0)
    layers = []
    for i in range(args.layers):
        fc = torch.nn.Linear(args.hidden, args.hidden)
        if args.mode == "tp":  # Megatron: column-split then row-split, alternating
            autopar.shard(fc, ((1, 1), (n, 1)) if i % 2 == 0 else ((1, n), (1, n)))
        layers += [fc, torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers[:-1])
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((args.batch * args.steps, args.hidden)).astype(np.float32)
    y = rng.standard_normal((args.batch * args.steps, args.hidden)).astype(np.float32)
    data = ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(args.batch)
    clock = StepClock(args.warmup)

    class Tick(Callback):
        def on_train_step_end(self, run_context):
            clock.tick()

    Model(net, torch.nn.MSELoss(), Momentum(net.parameters(), 1e-4, 0.9)).train(1, data, callbacks=[Tick()])
    param_mb = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in net.parameters()) / 2**20
    clock.report(f"mlp_{args.mode}", rank, n, args.batch, param_mb_per_rank=round(param_mb, 1),
                 hidden=args.hidden, layers=args.layers)


if __name__ == "__main__":
    main()
