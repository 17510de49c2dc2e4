"""Each speed lever of DATA_PARALLEL measured on its own, on plain torch DDP (prints JSON).

Tutorial ResNet-50, 32x32, batch 32 per worker, 2 workers x 1 thread (torchrun, gloo), in-memory batches, so
that only the lever changes. Configurations alternate within each round; medians over rounds. ``no_comm`` is the
same two processes without DDP: the compute-only floor, so ``comm_cost`` = plain DDP - no_comm.

    python bench/levers.py [--rounds 2] [--steps 20]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from autopar.cluster.netutil import free_port

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "ddp_levers.py"

CONFIGS = {
    "plain_ddp": [],
    "no_comm": ["--ddp", "none"],
    "bucket_view": ["--view", "1"],
    "no_buffer_broadcast": ["--broadcast-buffers", "0"],
    "bucket_10mb": ["--bucket-mb", "10"],
    "bucket_100mb": ["--bucket-mb", "100"],
    "static_graph": ["--static-graph", "1"],
    "foreach_optimizer": ["--optimizer", "foreach"],
    "fused_optimizer": ["--optimizer", "fused"],
    "channels_last": ["--channels-last", "1"],
    "small_conv": ["--small-conv", "1"],
    "autopar_defaults": ["--view", "1", "--broadcast-buffers", "0", "--optimizer", "fused", "--small-conv", "1"],
    "defaults_allreduce_after_backward": ["--ddp", "after", "--optimizer", "fused", "--small-conv", "1"],
    "defaults_malloc": ["--view", "1", "--broadcast-buffers", "0", "--optimizer", "fused", "--small-conv", "1",
                        "--malloc", "1"],
    "defaults_malloc_no_comm": ["--ddp", "none", "--optimizer", "fused", "--small-conv", "1", "--malloc", "1"],
    "defaults_no_comm": ["--ddp", "none", "--optimizer", "fused", "--small-conv", "1"],
    "defaults_bf16_grads": ["--view", "1", "--broadcast-buffers", "0", "--optimizer", "fused", "--small-conv", "1",
                            "--compress", "bf16"],
}


def run(name: str, extra: list[str], steps: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(WORKLOAD), "--name", name, "--steps", str(steps), *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    rows = [json.loads(m) for m in re.findall(r"^BENCH (\{.*\})$", res.stdout, flags=re.M)]
    if res.returncode != 0 or len(rows) != 2:
        raise SystemExit(f"{name} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return {"images_per_s": min(r["images_per_s"] for r in rows), "step_s": max(r["steady_step_s"] for r in rows),
            "optimizer_s": max(r["opt_s"] for r in rows),
            "minor_faults": max(r["minor_faults"] for r in rows), "sys_s": max(r["sys_s"] for r in rows),
            "user_s": max(r["user_s"] for r in rows), "peak_rss_mb": max(r["peak_rss_mb"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--only", nargs="*", help="configurations to run (default: all)")
    args = p.parse_args()
    names = args.only or list(CONFIGS)
    if "plain_ddp" not in names:
        names.insert(0, "plain_ddp")
    results: dict[str, list[dict]] = {n: [] for n in names}
    for rnd in range(args.rounds):
        for name in names:
            results[name].append(run(name, CONFIGS[name], args.steps))
            print(f"[levers] round {rnd + 1} {name}: {results[name][-1]['images_per_s']:.1f} images/s",
                  file=sys.stderr, flush=True)
    summary = {n: {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]} for n, rows in results.items()}
    base = summary["plain_ddp"]["images_per_s"]
    for row in summary.values():
        row["vs_plain_ddp"] = round(row["images_per_s"] / base, 3)
    if "no_comm" in summary:
        summary["comm_cost_s_per_step"] = round(summary["plain_ddp"]["step_s"] - summary["no_comm"]["step_s"], 4)
    summary["config"] = {"model": "resnet50 (tutorial)", "image_size": 32, "batch_per_worker": 32, "workers": 2,
                         "threads_per_worker": 1, "steps": args.steps, "rounds": args.rounds}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
