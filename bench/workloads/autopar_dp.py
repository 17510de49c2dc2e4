"""Benchmark workload: the tutorial path on autopar (Cifar10Dataset pipeline + Model.train, DATA_PARALLEL)."""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import autopar as ap  # noqa: E402
from autopar.communication import get_group_size, get_rank, init  # noqa: E402
from autopar.models import resnet50  # noqa: E402
from autopar.nn import Momentum, SoftmaxCrossEntropyExpand  # noqa: E402
from autopar.train import Callback, Model  # noqa: E402
from autopar.train.recipes.resnet_cifar import create_dataset, set_seed  # noqa: E402

from common import StepClock  # noqa: E402


class Limited:
    """The dataset cut to ``steps`` batches per epoch (keeps per-step callbacks, unlike sink mode)."""

    def __init__(self, ds, steps):
        self.ds, self.steps = ds, steps
        self.waits = []

    def get_dataset_size(self):
        return self.steps

    def iter_epoch(self, epoch, start_step=0):
        """Also times how long the training loop waits for each batch (the data share of a step)."""
        it = iter(self.ds.iter_epoch(epoch, start_step=start_step))
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.waits.append(time.perf_counter() - t)
            yield batch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--graph-mode", action="store_true", help="set_context(mode=GRAPH_MODE): torch.compile")
    p.add_argument("--amp-level", default="O0")
    p.add_argument("--no-comm", action="store_true",
                   help="each rank trains stand-alone: everything but the gradient all-reduce (its cost = the difference)")
    args = p.parse_args()

    if args.graph_mode:
        ap.set_context(mode=ap.GRAPH_MODE)
    ap.set_auto_parallel_context(parallel_mode="stand_alone" if args.no_comm else "data_parallel", gradients_mean=True)
    init()
    set_seed(1)
    clock = StepClock(args.warmup)

    losses = []

    class Tick(Callback):
        def on_train_step_end(self, run_context):
            clock.tick()
            losses.append(round(float(run_context.original_args().net_outputs), 5))

    dataset = create_dataset(args.data, args.batch, args.image_size)
    net = resnet50(args.batch, 10)
    model = Model(net, SoftmaxCrossEntropyExpand(sparse=True), Momentum(net.parameters(), 0.01, 0.9),
                  amp_level=args.amp_level)
    limited = Limited(dataset, args.steps)
    model.train(1, limited, callbacks=[Tick()])
    name = ("autopar_nocomm" if args.no_comm else "autopar_dp") + ("_graph" if args.graph_mode else "") + (
        "" if args.amp_level == "O0" else f"_{args.amp_level}")
    clock.report(name, get_rank(), get_group_size(), args.batch, torch_threads=torch.get_num_threads(),
                 first_step_s=clock.ends[0] - clock.start if clock.ends else None, losses=losses,
                 data_wait_s=statistics.median(limited.waits[args.warmup:]) if len(limited.waits) > args.warmup else None)


if __name__ == "__main__":
    main()
