"""Two hosts made of network namespaces vs one host's loopback: all-reduce bandwidth and the tutorial job's images/s
(prints JSON). Needs root (the hosts are built as in tests/netns.py and always removed).

- ``allreduce``: 2 ranks (torchrun contract, gloo), one per host over a veth pair and a bridge, vs both on one host
  over 127.0.0.1; per size the median time of an all-reduce and its bus bandwidth 2(n-1)/n x bytes / time.
- ``tutorial``: ResNet-50 DATA_PARALLEL (bench/workloads/autopar_dp.py, the Cifar10Dataset pipeline + Model.train),
  ``autopar launch --nnodes 2`` with one rank per host vs ``autopar launch -n 2`` on one host.
Configurations alternate round by round; medians over rounds. Both hosts share this machine's cores and memory:
the difference is the network path (veth + bridge vs loopback), not the hardware.

    python bench/netns_hosts.py [--rounds 3] [--steps 30] [--sizes-mb 1,25,90]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the namespace cluster of the tests
sys.path.insert(0, str(HERE))
from dp_throughput import WORK  # noqa: E402

from netns import NetnsCluster, unavailable  # noqa: E402

PORT = "29601"
ALLREDUCE = r"""
import json, os, statistics, sys, time
import torch, torch.distributed as dist
import autopar
autopar.init()
out = {}
for mb in [float(s) for s in sys.argv[1].split(",")]:
    t = torch.ones(int(mb * 2**20 / 4))
    times = []
    for i in range(int(sys.argv[2]) + 2):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    out[str(mb)] = statistics.median(times[2:])
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(out), flush=True)
"""


def _env(**extra) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{k: str(v) for k, v in extra.items()})


def allreduce(cluster: NetnsCluster, two_hosts: bool, sizes: str, iters: int) -> dict[str, float]:
    master = cluster.addresses[0] if two_hosts else "127.0.0.1"
    procs = [subprocess.Popen(cluster.cmd(r if two_hosts else 0, [sys.executable, "-c", ALLREDUCE, sizes, str(iters)]),
                              env=_env(RANK=r, WORLD_SIZE=2, LOCAL_RANK=0 if two_hosts else r, MASTER_ADDR=master,
                                       MASTER_PORT=PORT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    found = re.search(r"^RESULT (\{.*\})$", outs[0], flags=re.M)
    if not found:
        raise SystemExit(f"all-reduce run failed:\n{outs[0][-3000:]}")
    return json.loads(found[1])


def tutorial(cluster: NetnsCluster, two_hosts: bool, common: list[str], logs: Path) -> float:
    launch = [sys.executable, "-m", "autopar.cli.main", "launch"]
    script = [str(WORK / "autopar_dp.py"), *common]
    if two_hosts:
        cmds = [cluster.cmd(k, [*launch, "-n", "1", "--nnodes", "2", "--node-rank", str(k), "--master-addr",
                                cluster.addresses[0], "--master-port", PORT, "--token", "t" * 32, "--log-dir",
                                str(logs / f"n{k}"), *script]) for k in range(2)]
    else:
        cmds = [cluster.cmd(0, [*launch, "-n", "2", "--log-dir", str(logs / "n0"), *script])]
    procs = [subprocess.Popen(c, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    text = "".join(p.communicate(timeout=1800)[0] for p in procs)
    for log in sorted(logs.glob("n*/worker_*.log")):
        text += log.read_text()
    rows = {json.loads(m)["rank"]: json.loads(m) for m in re.findall(r"^BENCH (\{.*\})$", text, flags=re.M)}
    rows = list(rows.values())  # rank 0 is both streamed by its launcher and in its log
    if any(p.returncode for p in procs) or len(rows) != 2:
        raise SystemExit(f"tutorial run failed:\n{text[-3000:]}")
    return min(r["images_per_s"] for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sizes-mb", default="1,25,90")
    args = p.parse_args()
    reason = unavailable()
    if reason:
        raise SystemExit(f"bench/netns_hosts.py: {reason}")
    from autopar.dataset.synth import write_synthetic_cifar10

    tmp = Path(tempfile.mkdtemp(prefix="autopar-netns-bench-"))
    data = str(write_synthetic_cifar10(tmp / "data").parent)
    common = ["--data", data, "--steps", str(args.steps), "--warmup", "6", "--batch", "32"]
    cluster = NetnsCluster(2)
    ar: dict[str, list[dict[str, float]]] = {"loopback": [], "two_hosts": []}
    tut: dict[str, list[float]] = {"loopback": [], "two_hosts": []}
    try:
        for rnd in range(args.rounds):
            for name in ("loopback", "two_hosts"):
                ar[name].append(allreduce(cluster, name == "two_hosts", args.sizes_mb, args.iters))
                tut[name].append(tutorial(cluster, name == "two_hosts", common, tmp / f"{name}-{rnd}"))
                print(f"[bench] round {rnd + 1} {name}: {tut[name][-1]:.1f} images/s, all-reduce "
                      + ", ".join(f"{mb} MB {s * 1e3:.1f} ms" for mb, s in ar[name][-1].items()),
                      file=sys.stderr, flush=True)
    finally:
        cluster.close()
    summary: dict[str, dict] = {}
    for name in ar:
        per_size = {}
        for mb in ar[name][0]:
            t = statistics.median(r[mb] for r in ar[name])
            per_size[f"{mb}_mb"] = {"ms": round(t * 1e3, 2), "bus_gb_per_s": round(float(mb) * 2**20 / t / 1e9, 3)}
        summary[name] = {"allreduce": per_size, "tutorial_images_per_s": round(statistics.median(tut[name]), 2),
                         "tutorial_rounds": [round(v, 2) for v in tut[name]]}
    summary["two_hosts_vs_loopback"] = {
        "tutorial_images_per_s": round(summary["two_hosts"]["tutorial_images_per_s"]
                                       / summary["loopback"]["tutorial_images_per_s"], 3),
        **{f"allreduce_{k}_time": round(summary["two_hosts"]["allreduce"][k]["ms"] / v["ms"], 3)
           for k, v in summary["loopback"]["allreduce"].items()}}
    summary["setup"] = {"ranks": 2, "threads_per_rank": 1, "rounds": args.rounds, "steps": args.steps,
                        "batch_per_rank": 32, "model": "ResNet-50 32x32", "cpus": os.cpu_count()}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
