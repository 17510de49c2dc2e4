"""Benchmark workload: one DDP training configuration of the tutorial ResNet-50, levers set by flags.

Run under torchrun (or as one process with --ddp none). Prints one ``BENCH {json}`` line per rank, with the
steady step time split into forward+backward (communication overlapped inside backward) and the optimizer step.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import emit, peak_rss_mb  # noqa: E402

from autopar.models import resnet50  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="ddp")
    p.add_argument("--ddp", choices=["ddp", "none"], default="ddp")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--view", type=int, default=0, help="gradient_as_bucket_view")
    p.add_argument("--broadcast-buffers", type=int, default=1)
    p.add_argument("--static-graph", type=int, default=0)
    p.add_argument("--channels-last", type=int, default=0)
    p.add_argument("--optimizer", choices=["default", "foreach", "fused"], default="default")
    p.add_argument("--flush-denormal", type=int, default=0)
    p.add_argument("--compress", choices=["none", "bf16", "fp16"], default="none",
                   help="torch's DDP gradient compression hooks (change results beyond float tolerance: not a default)")
    p.add_argument("--small-conv", type=int, default=0, help="autopar.parallel.small_conv: tiny-map convs as GEMMs")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    if args.flush_denormal:
        torch.set_flush_denormal(True)
    torch.manual_seed(1)
    net = resnet50(args.batch, 10)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    net = net.to(memory_format=fmt)
    if args.small_conv:
        from autopar.parallel.small_conv import install

        install(net)
    model = net
    if args.ddp == "ddp" and world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            net, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=bool(args.view),
            broadcast_buffers=bool(args.broadcast_buffers), static_graph=bool(args.static_graph))
    if args.compress != "none" and model is not net:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.bf16_compress_hook if args.compress == "bf16" else default_hooks.fp16_compress_hook
        model.register_comm_hook(None, hook)
    kw = {"foreach": True} if args.optimizer == "foreach" else {"fused": True} if args.optimizer == "fused" else {}
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, **kw)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, 32, 32, generator=g).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    steps, fb, st = [], [], []
    for i in range(args.steps):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        t2 = time.perf_counter()
        if i >= args.warmup:
            steps.append(t2 - t0)
            fb.append(t1 - t0)
            st.append(t2 - t1)
    med = statistics.median
    emit({
        "bench": args.name, "rank": rank, "world": world, "steady_step_s": med(steps), "fwd_bwd_s": med(fb),
        "opt_s": med(st), "images_per_s": world * args.batch / med(steps), "peak_rss_mb": peak_rss_mb()})
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
