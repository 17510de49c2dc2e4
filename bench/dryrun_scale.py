"""A dry run at scale: a GPT of 32 layers, hidden 4096, vocabulary 32000, sequence 2048 (6.6e9 parameters) on 1024
simulated ranks, one sequence per rank, with ZeRO-3 -- the network built eagerly (whole on every rank, then
sharded) and under ``autopar.deferred_init`` (each rank makes only its shards) -- and with plain data parallel:
`autopar launch --dry-run` as a user runs it (imports included), on this machine. Per case and round: wall seconds,
the largest resident memory of the simulated rank's process, and the predicted per-rank memory (the whole run,
setting up included, and a training step with its parts).

    python bench/dryrun_scale.py [--rounds 2] [--out bench/results/dryrun_scale.json]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests", "scripts", "dryrun_gpt.py")
GPT = ["32", "4096", "32000", "2048", "1"]
CASES = [("zero3", 1024), ("zero3-deferred", 1024), ("dp", 1024)]


def _one(case: str, world: int) -> dict:
    mode, _, build = case.partition("-")
    with tempfile.TemporaryDirectory() as logs:
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "autopar.cli.main", "launch", "--dry-run", "-n", str(world),
                              "--log-dir", logs, SCRIPT, mode, *GPT, build or "eager"], capture_output=True,
                             text=True)
        wall = time.perf_counter() - t0
        if res.returncode:
            raise SystemExit(f"{mode}: {res.stderr.strip()}")
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB, the largest child so far
        report = json.load(open(os.path.join(logs, "dryrun.json")))
    rank = report["ranks"]["0"]
    return {"wall_s": wall, "max_rss_gib": rss / 2**20, "rss_grew": rss > before, "peak_bytes": rank["peak_bytes"],
            "step": rank["steady"], "setup": {k: rank[k] for k in ("parameters", "gradients", "optimizer",
                                                                      "activations", "other")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    runs: dict = {f"{m}@{n}": [] for m, n in CASES}
    for r in range(args.rounds):
        for mode, world in CASES:
            one = _one(mode, world)
            runs[f"{mode}@{world}"].append(one)
            print(f"round {r + 1} {mode}@{world}: {one['wall_s']:.1f} s, max RSS {one['max_rss_gib']:.2f} GiB, "
                  f"step peak {one['step']['peak_bytes'] / 2**30:.2f} GiB/rank", flush=True)
    summary = {k: {"wall_s_median": statistics.median(x["wall_s"] for x in v),
                   "max_rss_gib": max(x["max_rss_gib"] for x in v), "step": v[-1]["step"],
                   "peak_bytes": v[-1]["peak_bytes"], "setup": v[-1]["setup"]} for k, v in runs.items()}
    z, d = summary["zero3@1024"]["step"], summary["dp@1024"]["step"]
    summary["zero3_setup_over_step"] = {k: summary[k]["peak_bytes"] / summary[k]["step"]["peak_bytes"]
                                        for k in ("zero3@1024", "zero3-deferred@1024")}
    state = ("parameters", "gradients", "optimizer")
    summary["dp_over_zero3_state"] = sum(d[k] for k in state) / sum(z[k] for k in state)
    out = {"gpt": dict(zip(["layers", "hidden", "vocab", "seq", "batch_per_rank"], map(int, GPT))),
           "rounds": args.rounds, "summary": summary, "runs": runs}
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
