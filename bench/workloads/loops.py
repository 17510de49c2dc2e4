"""Benchmark workload: one hand-written training loop, three ways to make it data-parallel.

- ``--engine ddp``     : torchrun + ``torch.nn.parallel.DistributedDataParallel`` (plain DDP, torch's defaults);
- ``--engine autopar`` : ``autopar launch`` with only ``set_auto_parallel_context(DATA_PARALLEL)`` and ``init()``
                         added -- the loop itself untouched (docs/any-loop.md);
- ``--engine autopar --loop model``: the same network, optimizer and in-memory batches through ``Model.train``;
- ``--engine none``    : the same processes, each training alone (compute only).

The network is a plain ResNet-50 ``nn.Module`` (torchvision's, 10 classes, or the tutorial's with ``--net
tutorial``), SGD with momentum, batches already in memory (no input pipeline in the measurement)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from torch_ddp import load_batches  # noqa: E402

from common import StepClock, hand_loop  # noqa: E402


def network(kind: str, batch: int) -> torch.nn.Module:
    if kind == "tutorial":
        from autopar.models import resnet50

        return resnet50(batch, 10)
    import torchvision

    return torchvision.models.resnet50(num_classes=10)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--engine", choices=["ddp", "autopar", "none"], required=True)
    p.add_argument("--loop", choices=["plain", "model"], default="plain")
    p.add_argument("--net", choices=["torchvision", "tutorial"], default="torchvision")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image-size", type=int, default=32)
    args = p.parse_args()
    if args.engine == "autopar":
        import autopar

        autopar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
        autopar.init()
        rank, world = autopar.get_rank(), autopar.get_group_size()
    else:
        import torch.distributed as dist

        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        if world > 1:
            dist.init_process_group("gloo")
    torch.manual_seed(1)
    net = network(args.net, args.batch)
    model = (torch.nn.parallel.DistributedDataParallel(net) if args.engine == "ddp" and world > 1 else net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    batches = load_batches(args.data, rank, world, args.batch, args.steps, args.image_size)
    clock = StepClock(args.warmup)
    if args.loop == "model":
        from autopar.train import Callback, Model

        class Tick(Callback):
            def on_train_step_end(self, run_context):
                clock.tick()

        Model(net, torch.nn.CrossEntropyLoss(), opt).train(1, batches, callbacks=[Tick()])
    else:
        hand_loop(model, opt, batches, clock)
    engine = ""
    if args.engine == "autopar":
        try:  # (an earlier autopar, measured with bench/loops.py --before, has no state to describe)
            from autopar.parallel.state import state_of

            engine = state_of(net).describe()
        except ImportError:
            engine = "earlier autopar"
    clock.report(f"{args.engine}_{args.loop}", rank, world, args.batch, torch_threads=torch.get_num_threads(),
                 engine=engine)


if __name__ == "__main__":
    main()
