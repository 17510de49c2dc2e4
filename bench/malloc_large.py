"""The allocator lever on large blocks: each plan with ``AUTOPAR_MALLOC=1`` (freed memory kept in the heap, no
``mmap`` at all) against ``AUTOPAR_MALLOC=0`` (glibc's own thresholds), interleaved round by round (prints JSON).

Why: glibc maps every block above its mmap threshold (32 MB at most) afresh and unmaps it on free, so a 64 MB
weight's gradient -- made anew every step -- is page-faulted in every step (16,384 faults, each a kernel entry, and
in a VM an exit too). Workloads of ``bench/auto_vs_hand.py``: the wide MLP (4 x 4096, 64 MB per layer) under data
parallel and Megatron's pairs, and ResNet-50 (no block that large: the control) under data parallel; the slowest
rank's median steady step, its CPU and system seconds per step.

    python bench/malloc_large.py [--nproc 2 4] [--rounds 3] [--steps 12]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dp_throughput import WORK, _run  # noqa: E402

CASES = (("mlp", "dp"), ("mlp", "megatron"), ("resnet50", "dp"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="autopar-malloc-"))
    runs: dict = {}
    for rnd in range(args.rounds):
        for n in args.nproc:
            for model, strategy in CASES:
                for malloc in ("0", "1"):
                    logs = tmp / f"{model}-{strategy}-{n}-{malloc}-{rnd}"
                    logs.mkdir()
                    cmd = [sys.executable, "-m", "autopar.cli.main", "launch", "-n", str(n), "--log-dir", str(logs),
                           str(WORK / "auto_vs_hand.py"), "--model", model, "--strategy", strategy, "--steps",
                           str(args.steps)]
                    rows = _run(cmd, 1, logs, {"AUTOPAR_MALLOC": malloc, "AUTOPAR_CACHE_DIR": str(tmp / "cache")})
                    entry = runs.setdefault(f"{model}/{strategy}/n{n}", {}).setdefault(f"malloc={malloc}", [])
                    entry.append({"step_s": max(r["steady_step_s"] for r in rows),
                                  "cpu_s": max(r["cpu_step_s"] for r in rows),
                                  "system_s": max(r["system_step_s"] for r in rows)})
                    print(f"[bench] round {rnd + 1} {model} {strategy} n={n} AUTOPAR_MALLOC={malloc}: "
                          f"{entry[-1]['step_s']:.3f} s", file=sys.stderr, flush=True)
    report = {}
    for case, sides in runs.items():
        out = {side: {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]} | {
            "rounds": [round(r["step_s"], 4) for r in rows]} for side, rows in sides.items()}
        out["step_ratio_on_over_off"] = round(out["malloc=1"]["step_s"] / out["malloc=0"]["step_s"], 3)
        report[case] = out
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
