"""Benchmark workload: one model under one strategy (auto | dp | zero1 | zero3 | megatron | sharded | mixed | cp | ep),
timed;
rank 0 prints the measured steady step time and the cost model's prediction for the same assignment (one JSON line)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import autopar  # noqa: E402
from autopar.communication import get_group_size, get_rank, init  # noqa: E402
from autopar.models import LlamaBlock, MoEBlock, TransformerBlock, mlp, resnet50  # noqa: E402
from autopar.nn import Momentum, SoftmaxCrossEntropyExpand  # noqa: E402
from autopar.train import Callback, Model  # noqa: E402

from common import StepClock  # noqa: E402

MODELS = {
    "resnet50": lambda: (resnet50(num_classes=10), SoftmaxCrossEntropyExpand(sparse=True), 32,
                         lambda b: (torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,), dtype=torch.int32))),
    "mlp": lambda: (mlp(4096, 4), torch.nn.MSELoss(), 8, lambda b: (torch.randn(b, 4096), torch.randn(b, 4096))),
    "transformer": lambda: (TransformerBlock(512, 8, 2048), torch.nn.MSELoss(), 4,
                            lambda b: (torch.randn(b, 128, 512), torch.randn(b, 128, 512))),
    "llama": lambda: (LlamaBlock(512, 8, 2, 1408, 128), torch.nn.MSELoss(), 4,
                      lambda b: (torch.randn(b, 128, 512), torch.randn(b, 128, 512))),
    # long context: one 2,048-token sequence per device through causal SDPA
    "longseq": lambda: (LlamaBlock(256, 8, 4, 704, 2048, causal=True), torch.nn.MSELoss(), 1,
                        lambda b: (torch.randn(b, 2048, 256), torch.randn(b, 2048, 256))),
    # long context as it is trained: one 4,096-token sequence for the whole job (full_batch: the ranks cannot split
    # the batch, only the sequence, the weights or nothing)
    "longctx": lambda: (LlamaBlock(256, 8, 4, 704, 4096, causal=True), torch.nn.MSELoss(), 1,
                        lambda b: (torch.randn(b, 4096, 256), torch.randn(b, 4096, 256))),
    # mixture of experts: 8 SwiGLU experts, top-2, 4 x 64 tokens per device
    "moe": lambda: (MoEBlock(256, 8, 1024, 2), torch.nn.MSELoss(), 4,
                    lambda b: (torch.randn(b, 64, 256), torch.randn(b, 64, 256))),
}
# Megatron's pairs: column-split modules feed row-split ones
COLUMNS = {"transformer": ("q", "k", "v", "ff1"), "llama": ("q", "k", "v", "gate", "up"),
           "longseq": ("q", "k", "v", "gate", "up"), "longctx": ("q", "k", "v", "gate", "up")}
ROWS = {"transformer": ("proj", "ff2"), "llama": ("o", "down"), "longseq": ("o", "down"), "longctx": ("o", "down")}
FULL_BATCH = {"longctx"}  # the batch given is the job's (every rank loads it whole), not each device's
ZERO = {"zero1": "level1", "zero3": "level3"}
VARIANTS = {"cp": "context parallel", "ep": "data parallel + expert parallel"}  # AUTO's names for them


HAND = ("megatron", "sharded", "mixed")


def _mixed(name: str, net: torch.nn.Module, n: int) -> None:
    """Data x tensor: on 4+ ranks a (n/2 data) x (2 tensor) mesh of Megatron pairs; on 2 ranks half the network
    tensor parallel (MLP: the first two layers; transformer: attention) and the rest data parallel."""
    if n >= 4 and n % 2 == 0:
        d, t = n // 2, 2
        col, row, c3, r3 = ((d, 1), (t, 1)), ((d, t), (1, t)), ((d, 1, 1), (t, 1)), ((d, 1, t), (1, t))
        if name == "mlp":
            for i, layer in enumerate(net):
                if isinstance(layer, torch.nn.Linear):
                    autopar.shard(layer, col if i % 4 == 0 else row)
        else:
            for mod in COLUMNS[name]:
                autopar.shard(getattr(net, mod), c3)
            for mod in ROWS[name]:
                autopar.shard(getattr(net, mod), r3)
        return
    col, row, dp = ((1, 1), (n, 1)), ((1, n), (1, n)), ((n, 1), (1, 1))
    if name == "mlp":
        linears = [m for m in net if isinstance(m, torch.nn.Linear)]
        for i, layer in enumerate(linears):
            autopar.shard(layer, (col if i == 0 else row) if i < 2 else dp)
    else:  # attention tensor parallel, the MLP data parallel
        c3, r3, dp3 = ((1, 1, 1), (n, 1)), ((1, 1, n), (1, n)), ((n, 1, 1), (1, 1))
        for mod in ("q", "k", "v"):
            autopar.shard(getattr(net, mod), c3)
        autopar.shard(getattr(net, ROWS[name][0]), r3)
        for mod in COLUMNS[name][3:] + ROWS[name][1:]:
            autopar.shard(getattr(net, mod), dp3)


def hand_annotate(name: str, net: torch.nn.Module, strategy: str, n: int) -> None:
    if strategy == "mixed":
        return _mixed(name, net, n)
    col, row = ((1, 1), (n, 1)), ((1, n), (1, n))
    if name == "mlp":
        for i, layer in enumerate(net):
            if isinstance(layer, torch.nn.Linear):
                autopar.shard(layer, col if strategy == "sharded" or i % 4 == 0 else row)
    elif name in COLUMNS:
        c3, r3 = ((1, 1, 1), (n, 1)), ((1, 1, n), (1, n))
        for mod in COLUMNS[name]:
            autopar.shard(getattr(net, mod), c3)
        for mod in ROWS[name]:
            autopar.shard(getattr(net, mod), c3 if strategy == "sharded" else r3)
    else:  # resnet50: split every convolution's output channels (model parallel)
        for mod in net.modules():
            if isinstance(mod, torch.nn.Conv2d):
                autopar.shard(mod, ((1, 1, 1, 1), (n, 1, 1, 1)))
        autopar.shard(net.fc, ((1, 1), (1, 1)))


def predicted(name, strategy, n):
    """The cost model's step time for the assignment this run uses (same machine model as the planner)."""
    from autopar.parallel.data.step_timer import DATA_PARALLEL_STEP
    from autopar.planner.machine import load_or_calibrate
    from autopar.planner.plan import plan_network

    net, loss, per_device, make = MODELS[name]()
    if strategy in HAND:
        hand_annotate(name, net, strategy, n)
    mode = "sharding_propagation" if strategy in HAND else "dynamic_programming"
    autopar.set_auto_parallel_context(dataset_strategy="data_parallel")  # (cp's own: the planner weighs cp itself)
    with autopar.context.managed():  # the trace calls the network: it must not parallelize itself meanwhile
        plan = plan_network(net, loss, make(per_device if name in FULL_BATCH else per_device * n), n,
                            load_or_calibrate(), mode,
                            data_parallel_step=DATA_PARALLEL_STEP)
    if strategy == "dp":
        return plan.dp_totals.step
    if strategy in VARIANTS:  # (a variant the planner does not weigh here has no prediction; the sequence split
        # is weighed per algorithm where several can run: the hand plan's is the default, the all-gather)
        label = f"{VARIANTS[strategy]} {n}"
        variant = plan.variants.get(label) or plan.variants.get(f"{label} (all_gather)")
        return variant[2].step if variant else float("nan")
    if strategy in ZERO:
        return plan.zero[ZERO[strategy]].step
    return plan.totals.step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--strategy", choices=("auto", "dp") + tuple(ZERO) + HAND + tuple(VARIANTS), required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    mode = {"auto": "auto_parallel", "dp": "data_parallel"}.get(args.strategy, "semi_auto_parallel")
    if args.strategy in ZERO:
        mode = "data_parallel"
        autopar.set_auto_parallel_context(enable_parallel_optimizer=True,
                                          parallel_optimizer_config={"optimizer_level": ZERO[args.strategy]})
    autopar.set_auto_parallel_context(parallel_mode=mode, gradients_mean=True,
                                      full_batch=args.model in FULL_BATCH and args.strategy != "cp")
    init()
    n, rank = get_group_size(), get_rank()
    net, loss, per_device, make = MODELS[args.model]()
    if args.strategy in HAND:
        hand_annotate(args.model, net, args.strategy, n)
    if args.strategy == "ep":
        autopar.shard(net.experts, "expert")
    torch.manual_seed(0 if args.model in FULL_BATCH else rank)
    batches = [make(per_device) for _ in range(args.steps)]
    if args.strategy == "cp":  # the same global batch, each rank its slice of every sequence
        autopar.set_auto_parallel_context(dataset_strategy=((1, n, 1), (1, n, 1)))
        torch.manual_seed(0)
        whole = per_device if args.model in FULL_BATCH else per_device * n
        batches = [tuple(t[:, rank * t.shape[1] // n:(rank + 1) * t.shape[1] // n].clone() for t in make(whole))
                   for _ in range(args.steps)]
    clock = StepClock(args.warmup)

    class Tick(Callback):
        def on_train_step_end(self, run_context):
            clock.tick()

    Model(net, loss, Momentum(net.parameters(), 1e-4, 0.9)).train(1, batches, callbacks=[Tick()])
    pred = predicted(args.model, args.strategy, n)
    extra = {}
    if args.strategy == "auto" and rank == 0:  # what the measured round found (plan, predicted s, measured s)
        from autopar.parallel.state import state_of

        plan = getattr(state_of(net), "plan", None)
        extra = {"auto_trials": getattr(plan, "trials", []), "auto_reason": getattr(plan, "reason", "")}
        if plan is not None:  # the prediction of the plan that ran (the measured round may have kept a runner-up)
            pred = plan.totals.step
    clock.report(f"{args.model}/{args.strategy}", rank, n, per_device, predicted_step_s=pred, **extra)


if __name__ == "__main__":
    main()
