"""One benchmark run: an MLP trained with AdamW for a few steps in one of DP / ZeRO-1/2/3 / 2-stage pipeline /
one process, reporting the steady step time and the bytes of parameters + gradients + optimizer state this rank
holds (its local shards), plus peak RSS.

    autopar launch -n N sharding.py --mode dp|level1|level2|level3|pipeline|single --hidden H --layers L
"""
from __future__ import annotations

import argparse

import torch

import autopar
from autopar.communication import get_group_size, get_rank, init
from common import StepClock


def held_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim():
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="global batch")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    zero = args.mode.startswith("level")
    if args.mode != "single":
        mode = "semi_auto_parallel" if args.mode == "pipeline" else "data_parallel"
        autopar.set_auto_parallel_context(parallel_mode=mode, gradients_mean=True, enable_parallel_optimizer=zero,
                                          parallel_optimizer_config={"optimizer_level": args.mode} if zero else {})
    init()
    rank, world = get_rank(), get_group_size()
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 10))
    loss_fn = torch.nn.functional.cross_entropy
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    runner = None
    if args.mode == "pipeline":
        runner = autopar.PipelineParallel(net, loss_fn, args.micro, split_points=[str(2 * (args.layers // 2))])
    # the pipeline: 2 stages x world/2 replicas, each replica's batch split into micro-batches
    local = args.batch if args.mode == "single" else args.batch // (world // 2 if args.mode == "pipeline" else world)
    x, y = torch.randn(local, args.hidden), torch.randint(0, 10, (local,))
    clock = StepClock(warmup=2)
    for _ in range(args.steps):
        if runner is not None:
            runner.step(x, y)
        else:
            loss_fn(net(x), y).backward()
        state_bytes = held_bytes(v for s in opt.state.values() for v in s.values())
        grad_bytes = held_bytes(p.grad for p in (runner.stage_module if runner else net).parameters()
                                if p.grad is not None)
        opt.step()
        opt.zero_grad()
        clock.tick()
    params = (runner.stage_module if runner else net).parameters()
    clock.report(args.mode, rank, world, local, param_mb=held_bytes(params) / 2**20, grad_mb=grad_bytes / 2**20,
                 optimizer_state_mb=state_bytes / 2**20)


if __name__ == "__main__":
    main()
