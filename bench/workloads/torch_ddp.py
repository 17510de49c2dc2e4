"""Benchmark workload: what a PyTorch user writes by hand -- torch DDP (gloo), SGD(momentum), cross-entropy, the
same ResNet-50, on batches already in memory (no input pipeline cost at all: an upper bound for plain DDP).
Started by torchrun (world > 1) or as one plain process (world 1, no DDP wrapper)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from autopar.models import resnet50  # noqa: E402

from common import StepClock, hand_loop  # noqa: E402


def load_batches(data_dir, rank, world, batch, steps, image_size):
    """Raw CIFAR-10 records of this rank's shard, normalised once into float tensors."""
    raw = np.fromfile(os.path.join(data_dir, "cifar-10-batches-bin", "data_batch_1.bin"), dtype=np.uint8)
    raw = raw.reshape(-1, 3073)[rank::world][: batch * steps]
    x = torch.from_numpy(raw[:, 1:].reshape(-1, 3, 32, 32).astype(np.float32) / 255.0)
    x = (x - torch.tensor([0.4465, 0.4822, 0.4914]).view(1, 3, 1, 1)) / torch.tensor([0.2010, 0.1994, 0.2023]).view(1, 3, 1, 1)
    if image_size != 32:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    y = torch.from_numpy(raw[:, 0].astype(np.int64))
    return list(zip(x.split(batch), y.split(batch)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--no-ddp", action="store_true", help="the same processes without DDP: compute only")
    p.add_argument("--autopar-levers", action="store_true",
                   help="apply autopar's speed defaults (parallel.tuning) to this hand loop: autopar's compute alone")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(1)
    net = resnet50(args.batch, 10)
    model = torch.nn.parallel.DistributedDataParallel(net) if world > 1 and not args.no_ddp else net
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    if args.autopar_levers:
        from autopar.perf import tuning

        tuning.tune_network(net)
        tuning.tune_optimizer(opt)
    batches = load_batches(args.data, rank, world, args.batch, args.steps, args.image_size)
    clock = StepClock(args.warmup)
    hand_loop(model, opt, batches, clock)
    name = "torch_single" if world == 1 else "torch_nocomm" if args.no_ddp else "torch_ddp"
    name += "_tuned" if args.autopar_levers else ""
    clock.report(name, rank, world, args.batch,
                 torch_threads=torch.get_num_threads())
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
