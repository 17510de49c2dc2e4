"""Benchmark workload: one DDP training configuration of the tutorial ResNet-50, levers set by flags.

Run under torchrun (or as one process with --ddp none). Prints one ``BENCH {json}`` line per rank, with the
steady step time split into forward+backward (communication overlapped inside backward) and the optimizer step.
"""
import argparse
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from autopar.models import resnet50  # noqa: E402

from common import emit, peak_rss_mb  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="ddp")
    p.add_argument("--ddp", choices=["ddp", "none", "after"], default="ddp",
                   help="after: no overlap -- a flat gradient buffer all-reduced in bucket-size chunks after backward")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--view", type=int, default=0, help="gradient_as_bucket_view")
    p.add_argument("--broadcast-buffers", type=int, default=1)
    p.add_argument("--static-graph", type=int, default=0)
    p.add_argument("--channels-last", type=int, default=0)
    p.add_argument("--optimizer", choices=["default", "foreach", "fused"], default="default")
    p.add_argument("--flush-denormal", type=int, default=0)
    p.add_argument("--compress", choices=["none", "bf16", "fp16"], default="none",
                   help="torch's DDP gradient compression hooks (change results beyond float tolerance: not a default)")
    p.add_argument("--small-conv", type=int, default=0, help="autopar.perf.small_conv: tiny-map convs as GEMMs")
    p.add_argument("--malloc", type=int, default=0, help="autopar.perf.tuning.tune_allocator (glibc thresholds)")
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
        from autopar.perf.small_conv import install

        install(net)
    if args.malloc:
        from autopar.perf.tuning import tune_allocator

        tune_allocator(net)
    model = net
    if args.ddp == "ddp" and world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            net, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=bool(args.view),
            broadcast_buffers=bool(args.broadcast_buffers), static_graph=bool(args.static_graph))
    if args.compress != "none" and model is not net:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.bf16_compress_hook if args.compress == "bf16" else default_hooks.fp16_compress_hook
        model.register_comm_hook(None, hook)
    flat = None
    if args.ddp == "after" and world > 1:  # gradients as views of one flat buffer (as gradient_as_bucket_view)
        params = [q for q in net.parameters() if q.requires_grad]
        flat = torch.zeros(sum(q.numel() for q in params))
        at = 0
        for q in params:
            q.grad = flat[at:at + q.numel()].view_as(q)
            at += q.numel()
        chunk = int(args.bucket_mb * 2**20 / 4)
    kw = {"foreach": True} if args.optimizer == "foreach" else {"fused": True} if args.optimizer == "fused" else {}
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, **kw)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, 32, 32, generator=g).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    steps, fb, st, faults = [], [], [], []
    for i in range(args.steps):
        f0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if flat is not None:
            for w in [dist.all_reduce(flat[a:a + chunk], async_op=True) for a in range(0, flat.numel(), chunk)]:
                w.wait()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=flat is None)
        loss.item()
        t2 = time.perf_counter()
        if i >= args.warmup:
            steps.append(t2 - t0)
            fb.append(t1 - t0)
            st.append(t2 - t1)
            f1 = resource.getrusage(resource.RUSAGE_SELF)
            faults.append((f1.ru_minflt - f0.ru_minflt, f1.ru_stime - f0.ru_stime, f1.ru_utime - f0.ru_utime))
    med = statistics.median
    emit({
        "bench": args.name, "rank": rank, "world": world, "steady_step_s": med(steps), "fwd_bwd_s": med(fb),
        "opt_s": med(st), "minor_faults": med(f[0] for f in faults), "sys_s": med(f[1] for f in faults),
        "user_s": med(f[2] for f in faults), "images_per_s": world * args.batch / med(steps),
        "peak_rss_mb": peak_rss_mb()})
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
