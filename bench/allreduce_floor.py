"""What the gradient all-reduce costs in CPU time, and the exposed-communication floor that follows (prints JSON).

Why: on a CPU cluster the all-reduce is not "on the wire" -- gloo's loopback TCP copies and sums are CPU work in
the ranks' own processes. When compute already saturates every core (2 workers x 1 thread on 2 cores), overlap can
hide waiting, not work: a step cannot be shorter than compute + the all-reduce's CPU time. This measures that CPU
time for ResNet-50's gradients (DDP's 25 MB buckets, issued back to back as DDP does) on idle cores, and turns it
into the smallest exposed share any overlap could reach for a given compute step.

Engines, interleaved round by round (``--rounds``): ``gloo`` (torch.distributed over loopback TCP, what DDP uses)
and ``shared_memory`` (autopar's :class:`~autopar.comm.host_memory.HostGroup`: the buckets summed in place in the
ranks' regions of one shared segment, where DATA_PARALLEL's gradients live on one host). Neither counts the copy of
each gradient into its bucket: DDP and autopar's reducer both make it.

    python bench/allreduce_floor.py [--ranks 2] [--iters 10] [--rounds 3] [--compute-s 0.293]

``--compute-s`` defaults to the tuned no-communication step measured by ``bench/dp_throughput.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.cluster.netutil import free_port


def _bucket_sizes(cap_mb: float) -> list[int]:
    """ResNet-50's gradient numels, grouped in reverse order into buckets of about ``cap_mb`` (DDP's cap; DDP's
    small first bucket is left out: the same bytes either way)."""
    from autopar.models.resnet import resnet50

    sizes, current, cap = [], 0, int(cap_mb * 2**20 / 4)
    for p in reversed(list(resnet50(10).parameters())):
        current += p.numel()
        if current >= cap:
            sizes.append(current)
            current = 0
    return sizes + ([current] if current else [])


def _cpu_s() -> tuple[float, float]:
    use = resource.getrusage(resource.RUSAGE_SELF)  # the whole process: gloo's threads included
    return use.ru_utime, use.ru_stime


def _rank(rank: int, world: int, port: int, sizes: list[int], iters: int, rounds: int, out) -> None:
    from autopar.comm.host_memory import HostGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    buckets = [torch.randn(n) for n in sizes]
    host = HostGroup.create(sum(sizes))
    host.region.normal_()
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)

    def gloo() -> None:
        for w in [dist.all_reduce(b, async_op=True) for b in buckets]:
            w.wait()

    def shared_memory() -> None:
        for start, stop in zip(bounds, bounds[1:]):
            host.all_reduce_range(start, stop)
        host.settle()

    results: dict[str, list[tuple[float, float, float]]] = {"gloo": [], "shared_memory": []}
    for _ in range(rounds):
        for name, run in (("gloo", gloo), ("shared_memory", shared_memory)):
            walls, cpus, syss = [], [], []
            for i in range(iters + 2):  # two warm-up rounds (connections, first-touch of the buffers)
                dist.barrier()
                t0, (u0, s0) = time.perf_counter(), _cpu_s()
                run()
                u1, s1 = _cpu_s()
                if i >= 2:
                    walls.append(time.perf_counter() - t0)
                    cpus.append(u1 + s1 - u0 - s0)
                    syss.append(s1 - s0)
            results[name].append((statistics.median(walls), statistics.median(cpus), statistics.median(syss)))
    out.put((rank, results))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--compute-s", type=float, default=0.293, help="compute-only step (s) to derive the floor for")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sizes = _bucket_sizes(args.bucket_mb)
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, sizes, args.iters, args.rounds, out))
             for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    rows = [out.get(timeout=1800)[1] for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    report = {"ranks": args.ranks, "buckets": len(sizes), "gradient_mb": round(sum(sizes) * 4 / 2**20, 1),
              "compute_step_s": args.compute_s, "rounds": args.rounds, "iters_per_round": args.iters}
    for name in rows[0]:
        # per round the slowest rank; medians over rounds
        wall = statistics.median(max(r[name][k][0] for r in rows) for k in range(args.rounds))
        cpu = statistics.median(max(r[name][k][1] for r in rows) for k in range(args.rounds))
        sys_ = statistics.median(max(r[name][k][2] for r in rows) for k in range(args.rounds))
        # per rank one core: the step is at least compute + this rank's all-reduce CPU time
        floor = cpu / (args.compute_s + cpu)
        budget_mb = sum(sizes) * 4 / 2**20 * (0.03 / 0.97 * args.compute_s) / cpu
        report[name] = {
            "allreduce_wall_ms_idle": round(wall * 1e3, 1), "allreduce_cpu_ms_per_rank": round(cpu * 1e3, 1),
            "of_which_system_ms": round(sys_ * 1e3, 1), "exposed_floor_pct": round(100 * floor, 1),
            "mb_allowed_for_3pct": round(budget_mb, 1),
            "cpu_ms_per_round": [round(max(r[name][k][1] for r in rows) * 1e3, 1) for k in range(args.rounds)],
        }
    report["cpu_ratio_gloo_over_shared_memory"] = round(
        report["gloo"]["allreduce_cpu_ms_per_rank"] / report["shared_memory"]["allreduce_cpu_ms_per_rank"], 2)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
