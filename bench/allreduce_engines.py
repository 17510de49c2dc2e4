"""Existing CPU all-reduce engines against gloo and autopar's shared-memory sum, on one host (prints JSON).

Why: issue 17 asked for an existing engine where one can serve. Each engine sums ResNet-50's gradients (DDP's four
25 MB buckets, float32, 2 ranks, 1 thread each) in place, 10 timed iterations after 2 warm-ups, rounds interleaved
engine by engine; per iteration the inputs are refilled outside the timed window and the sums checked against
``a + b`` computed locally (exact for two ranks). CPU = user + system of the whole process (helper threads too).

- ``gloo``: torch.distributed over loopback TCP (DDP's engine on the CPU);
- ``mpi``: OpenMPI's shared-memory transport (vader) through ``mpi4py`` -- needs ``mpirun`` (two processes started
  otherwise reach each other only through ``ompi-server`` and TCP: measured slower than gloo);
- ``deepspeed_shm``: DeepSpeed's CPU shared-memory all-reduce (``deepspeed.comm.inference_all_reduce``; compiles its
  C++ op on first use, needs ``LOCAL_SIZE`` = world size);
- ``autopar_shared_memory``: :class:`autopar.comm.host_memory.HostGroup`, the buffers copied into the rank's region
  and the sums copied back out (what the others do: an all-reduce of a user's tensors);
- ``autopar_in_region``: the same sum where DATA_PARALLEL's gradients live: already in the region, no copy.

Engines whose package is missing are reported as skipped (``pip install mpi4py deepspeed`` into the environment to
include them; oneCCL's ``oneccl_bind_pt`` has no wheel for current torch on PyPI).

    python bench/allreduce_engines.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = [6_619_136, 6_565_888, 6_819_840, 3_503_616]  # ResNet-50's gradient buckets (float32 elements)
WARMUP, ITERS = 2, 10


def _measure(rank: int, allreduce, barrier) -> dict:
    import torch

    def inputs(r: int) -> list:
        g = torch.Generator().manual_seed(r)
        return [torch.randn(n, generator=g) for n in SIZES]

    src = inputs(rank)
    expected = [a + b for a, b in zip(inputs(0), inputs(1))]
    bufs = [torch.empty_like(s) for s in src]
    walls, cpus, systems, exact = [], [], [], True
    for i in range(WARMUP + ITERS):
        for b, s in zip(bufs, src):
            b.copy_(s)
        barrier()
        u0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        allreduce(bufs)
        t1 = time.perf_counter()
        u1 = resource.getrusage(resource.RUSAGE_SELF)
        exact &= all(torch.equal(b, e) for b, e in zip(bufs, expected))
        if i >= WARMUP:
            walls.append(t1 - t0)
            cpus.append(u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime)
            systems.append(u1.ru_stime - u0.ru_stime)
    barrier()
    return {"wall_ms": 1e3 * statistics.median(walls), "cpu_ms": 1e3 * statistics.median(cpus),
            "system_ms": 1e3 * statistics.median(systems), "exact": exact}


def _worker(engine: str) -> None:
    """One rank of one engine (started by :func:`_run`); prints its row as ``ROW {json}``."""
    import torch

    torch.set_num_threads(1)
    if engine == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        row = _measure(comm.Get_rank(), lambda bufs: [comm.Allreduce(MPI.IN_PLACE, b.numpy(), op=MPI.SUM)
                                                      for b in bufs], comm.Barrier)
    elif engine == "deepspeed_shm":
        import deepspeed
        import deepspeed.comm as ds

        deepspeed.init_distributed(dist_backend="gloo")
        row = _measure(ds.get_rank(), lambda bufs: [ds.inference_all_reduce(b) for b in bufs], ds.barrier)
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://")
        rank = dist.get_rank()
        if engine == "gloo":
            def allreduce(bufs):
                for w in [dist.all_reduce(b, async_op=True) for b in bufs]:
                    w.wait()
        else:
            from autopar.comm.host_memory import HostGroup

            host = HostGroup.create(sum(SIZES))
            bounds = [0]
            for n in SIZES:
                bounds.append(bounds[-1] + n)
            views = [host.region[a:b] for a, b in zip(bounds, bounds[1:])]

            def allreduce(bufs):
                for (a, b), view, buf in zip(zip(bounds, bounds[1:]), views, bufs):
                    view.copy_(buf)
                    host.all_reduce_range(a, b)
                host.settle()
                for view, buf in zip(views, bufs):
                    buf.copy_(view)
        row = _measure(rank, allreduce, dist.barrier)
        if engine == "autopar_in_region":  # checked with the copies above; timed without them
            row |= _in_region_only(host, bounds, dist.barrier)
        dist.destroy_process_group()
    print("ROW " + json.dumps(row), flush=True)


def _in_region_only(host, bounds, barrier) -> dict:
    walls, cpus, systems = [], [], []
    for i in range(WARMUP + ITERS):
        barrier()
        u0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        for a, b in zip(bounds, bounds[1:]):
            host.all_reduce_range(a, b)
        host.settle()
        t1 = time.perf_counter()
        u1 = resource.getrusage(resource.RUSAGE_SELF)
        if i >= WARMUP:
            walls.append(t1 - t0)
            cpus.append(u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime)
            systems.append(u1.ru_stime - u0.ru_stime)
    return {"wall_ms": 1e3 * statistics.median(walls), "cpu_ms": 1e3 * statistics.median(cpus),
            "system_ms": 1e3 * statistics.median(systems)}


def _available(engine: str) -> str | None:
    """None when the engine can run here, else why not."""
    if engine == "mpi":
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed"
        if shutil.which("mpirun") is None:
            return "mpirun (OpenMPI) is not installed"
    if engine == "deepspeed_shm" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed"
    return None


def _run(engine: str, port: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", LOCAL_SIZE="2", WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", engine]
    if engine == "mpi":
        procs = [subprocess.Popen(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2", "--mca", "btl",
                                   "self,vader", *me], env=env, stdout=subprocess.PIPE, text=True)]
    else:
        procs = [subprocess.Popen(me, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                                  text=True) for r in range(2)]
    text = "".join(p.communicate(timeout=900)[0] for p in procs)
    rows = [json.loads(line[4:]) for line in text.splitlines() if line.startswith("ROW ")]
    if any(p.returncode for p in procs) or len(rows) != 2:
        raise SystemExit(f"{engine} failed:\n{text[-2000:]}")
    return {k: max(r[k] for r in rows) for k in ("wall_ms", "cpu_ms", "system_ms")} | {
        "exact": all(r["exact"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return _worker(args.worker)
    from autopar.cluster.netutil import free_port

    engines = ["gloo", "mpi", "deepspeed_shm", "autopar_shared_memory", "autopar_in_region"]
    skipped = {e: why for e in engines if (why := _available(e))}
    runs: dict[str, list[dict]] = {e: [] for e in engines if e not in skipped}
    for rnd in range(args.rounds):
        for engine in runs:
            runs[engine].append(_run(engine, free_port()))
            print(f"[engines] round {rnd + 1} {engine}: {runs[engine][-1]['cpu_ms']:.1f} ms CPU per rank",
                  file=sys.stderr, flush=True)
    report = {"buffers_mb": round(sum(SIZES) * 4 / 2**20, 1), "ranks": 2, "rounds": args.rounds, "skipped": skipped}
    for engine, rows in runs.items():
        report[engine] = {k: round(statistics.median(r[k] for r in rows), 1) for k in ("wall_ms", "cpu_ms",
                                                                                       "system_ms")}
        report[engine] |= {"cpu_ms_per_round": [round(r["cpu_ms"], 1) for r in rows],
                           "exact": all(r["exact"] for r in rows)}
    base = report["gloo"]["cpu_ms"]
    report["cpu_vs_gloo"] = {e: round(report[e]["cpu_ms"] / base, 2) for e in runs}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
