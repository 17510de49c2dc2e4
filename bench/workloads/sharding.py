"""One benchmark run: an MLP or a small transformer trained with AdamW for a few steps in one of DP / ZeRO-1/2/3 /
2-stage pipeline / one process, reporting the steady step time and the bytes of parameters + gradients + optimizer
state this rank holds (its local shards), plus peak RSS.

    autopar launch -n N sharding.py --mode dp|level1|level2|level3|pipeline|gpipe|single --model mlp|transformer
        --hidden H --layers L
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


class Block(torch.nn.Module):
    """A pre-norm transformer block (attention written with torch matmuls, as users write it; 4x MLP)."""

    def __init__(self, d: int, heads: int = 8):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


SEQ = 32


def build(model: str, hidden: int, layers: int) -> torch.nn.Sequential:
    if model == "transformer":
        return torch.nn.Sequential(*[Block(hidden) for _ in range(layers)], torch.nn.Linear(hidden, 10))
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(hidden, 10))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True)
    p.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="global batch")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    zero = args.mode.startswith("level")
    if args.mode != "single":
        mode = "semi_auto_parallel" if args.mode in ("pipeline", "gpipe") else "data_parallel"
        autopar.set_auto_parallel_context(parallel_mode=mode, gradients_mean=True, enable_parallel_optimizer=zero,
                                          parallel_optimizer_config={"optimizer_level": args.mode} if zero else {})
    init()
    rank, world = get_rank(), get_group_size()
    torch.manual_seed(0)
    net = build(args.model, args.hidden, args.layers)

    def loss_fn(out, y):  # per token for the transformer
        return torch.nn.functional.cross_entropy(out.reshape(-1, 10), y.reshape(-1))

    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    runner = None
    if args.mode in ("pipeline", "gpipe"):  # halfway: after layer L/2 (the MLP's Sequential: a ReLU after each Linear)
        half = args.layers // 2 if args.model == "transformer" else 2 * (args.layers // 2)
        runner = autopar.PipelineParallel(net, loss_fn, args.micro, split_points=[str(half)],
                                          schedule="gpipe" if args.mode == "gpipe" else "1f1b")
    # the pipeline: 2 stages x world/2 replicas, each replica's batch split into micro-batches
    piped = args.mode in ("pipeline", "gpipe")
    local = args.batch if args.mode == "single" else args.batch // (world // 2 if piped else world)
    shape = (local, SEQ, args.hidden) if args.model == "transformer" else (local, args.hidden)
    x, y = torch.randn(*shape), torch.randint(0, 10, shape[:-1])
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
