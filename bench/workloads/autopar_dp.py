"""Benchmark workload: the tutorial path on autopar (Cifar10Dataset pipeline + Model.train, DATA_PARALLEL)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from common import StepClock  # noqa: E402

import autopar as ap  # noqa: E402
from autopar.communication import get_group_size, get_rank, init  # noqa: E402
from autopar.models import resnet50  # noqa: E402
from autopar.nn import Momentum, SoftmaxCrossEntropyExpand  # noqa: E402
from autopar.train import Callback, Model  # noqa: E402
from autopar.train.recipes.resnet_cifar import create_dataset, set_seed  # noqa: E402


class Limited:
    """The dataset cut to ``steps`` batches per epoch (keeps per-step callbacks, unlike sink mode)."""

    def __init__(self, ds, steps):
        self.ds, self.steps = ds, steps

    def get_dataset_size(self):
        return self.steps

    def iter_epoch(self, epoch, start_step=0):
        return self.ds.iter_epoch(epoch, start_step=start_step)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image-size", type=int, default=32)
    args = p.parse_args()

    ap.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
    init()
    set_seed(1)
    clock = StepClock(args.warmup)

    class Tick(Callback):
        def on_train_step_end(self, run_context):
            clock.tick()

    dataset = create_dataset(args.data, args.batch, args.image_size)
    net = resnet50(args.batch, 10)
    model = Model(net, SoftmaxCrossEntropyExpand(sparse=True), Momentum(net.parameters(), 0.01, 0.9))
    model.train(1, Limited(dataset, args.steps), callbacks=[Tick()])
    clock.report("autopar_dp", get_rank(), get_group_size(), args.batch, torch_threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
