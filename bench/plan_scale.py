"""Planning time at scale: Llama-3-8B (32 layers, hidden 4096, GQA 32/8 heads, sequence 8192) on a 2-D mesh of
64 and 1024 H100s, and a 405B Llama (126 layers, hidden 16384, 128/8 heads, ffn 53248) on 16,384 H100s at 8,192
tokens and at Llama 3's long-context 131,072 (the h100-ib preset, a node type: 2,048 of its nodes), searched whole
(context x tensor x pipeline x data x micro-batch x ZeRO x recomputation, every decoder
layer's operators by the exact ILP, repeated layers grouped as one). Several rounds, interleaved; the median of the
planner's own clock and of the wall time of `autopar plan` as a user runs it (imports included).

    python bench/plan_scale.py [--rounds 3] [--out bench/results/plan_scale.json]
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

LLAMA_405B = ["--layers", "126", "--hidden", "16384", "--heads", "128", "--kv-heads", "8", "--ffn", "53248",
              "--seq", "8192"]
# (name, model flags, devices, global batch)
CASES = [("llama3-8b", ["--size", "llama3-8b"], 64, 1024), ("llama3-8b", ["--size", "llama3-8b"], 1024, 1024),
         ("llama-405b", LLAMA_405B, 16384, 2048), ("llama-405b-128k", LLAMA_405B[:-1] + ["131072"], 16384, 128)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    runs: dict = {}
    for _ in range(args.rounds):
        for size, flags, devices, batch in CASES:
            cmd = [sys.executable, "-m", "autopar.cli.main", "plan", "llama", *flags, "-n", str(devices),
                   "--global-batch", str(batch), "--machine", "h100-ib"]
            t0 = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            wall = time.perf_counter() - t0
            found = re.search(r"searched (\d+) plans in ([\d.]+) s", out)
            entry = runs.setdefault(f"{size}/n{devices}", {"plan_s": [], "wall_s": [], "mesh": None})
            entry["plan_s"].append(float(found.group(2)))
            entry["wall_s"].append(round(wall, 2))
            entry["plans"] = int(found.group(1))
            entry["mesh"] = re.search(r"^mesh: (.*?)  \(", out, re.M).group(1)
            entry["step"] = re.search(r"^predicted step: ([\d.]+) s", out, re.M).group(1)
            entry["mfu"] = re.search(r"MFU ([\d.]+%)", out).group(1)
            print(f"[bench] {size} n={devices}: {entry['plan_s'][-1]} s planning, {wall:.1f} s wall", file=sys.stderr)
    for entry in runs.values():
        entry["plan_s_median"] = statistics.median(entry["plan_s"])
        entry["wall_s_median"] = statistics.median(entry["wall_s"])
    text = json.dumps({"rounds": args.rounds, "machine": "h100-ib preset (as many nodes as the case needs), planned on this host", "cases": runs},
                      indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
