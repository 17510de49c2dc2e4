"""Optimizer sharding (ZeRO levels on FSDP2) and the 2-stage pipeline vs DATA_PARALLEL and one process, interleaved.

An MLP (default 8 x 2048^2 + head: ~33.6M parameters; --hidden 3584 gives ~103M) or a small transformer
(``--model transformer``: pre-norm blocks, 8 heads, 32 tokens per sample) trained with AdamW, global batch 32. Per configuration (medians over rounds): steady step time, and per rank the MB of parameters, gradients and
optimizer state it holds (its shards) -- expect 1/N for what a level shards -- and peak RSS. For the pipeline: step
time vs one process and the measured bubble 1 - T_single / (N x T_pipeline) against (S-1)/(M+S-1) (S = 2 stages x
N/2 replicas).

    python bench/sharding.py [--world 2] [--model mlp] [--rounds 3] [--hidden 2048] [--layers 8] [--micro 8]
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

MODES = ("dp", "level1", "level2", "level3", "pipeline", "single")  # also "gpipe": the pipeline on GPipe's schedule


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--modes", nargs="+", default=list(MODES), help="e.g. pipeline gpipe single: the two schedules")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="autopar-sharding-"))
    rows: dict[str, list[list[dict]]] = {m: [] for m in args.modes}
    for rnd in range(args.rounds):
        for mode in args.modes:
            logs = tmp / f"{mode}-{rnd}"
            logs.mkdir()
            n = 1 if mode == "single" else args.world  # a pipeline: 2 stages x world/2 replicas
            cmd = [sys.executable, "-m", "autopar.cli.main", "launch", "-n", str(n), "--log-dir", str(logs),
                   str(WORK / "sharding.py"), "--mode", mode, "--model", args.model, "--hidden", str(args.hidden), "--layers",
                   str(args.layers), "--micro", str(args.micro), "--steps", str(args.steps)]
            rows[mode].append(_run(cmd, 1, logs))
            print(f"[bench] round {rnd + 1} {mode}: {max(r['steady_step_s'] for r in rows[mode][-1]):.3f} s/step",
                  file=sys.stderr, flush=True)
    out: dict = {}
    for mode, runs in rows.items():
        out[mode] = {"world": runs[0][0]["world"],
                     "steady_step_s": round(statistics.median(max(r["steady_step_s"] for r in rs) for rs in runs), 4),
                     "rounds_step_s": [round(max(r["steady_step_s"] for r in rs), 4) for rs in runs],
                     "peak_rss_mb_per_rank": round(statistics.median(max(r["peak_rss_mb"] for r in rs) for rs in runs), 1)}
        for k in ("param_mb", "grad_mb", "optimizer_state_mb"):
            out[mode][k + "_per_rank"] = round(max(r[k] for r in runs[0]), 2)
    for level in ("level1", "level2", "level3"):
        if level in out and "dp" in out:
            dp = out["dp"]
            out[level]["step_vs_dp"] = round(out[level]["steady_step_s"] / dp["steady_step_s"], 3)
            out[level]["state_vs_dp"] = round(out[level]["optimizer_state_mb_per_rank"] / dp["optimizer_state_mb_per_rank"], 3)
    s, m = 2, args.micro
    for piped in ("pipeline", "gpipe"):
        if piped in out and "single" in out:
            single = out["single"]["steady_step_s"]
            out[piped]["speedup_vs_single"] = round(single / out[piped]["steady_step_s"], 3)
            # ideal: one process's step spread over all the ranks; what is missing is the bubble (and micro-batch
            # overhead)
            out[piped]["bubble_measured"] = round(1 - single / (args.world * out[piped]["steady_step_s"]), 3)
            out[piped]["bubble_model"] = round((s - 1) / (m + s - 1), 3)
    out["config"] = {"model": args.model, "hidden": args.hidden, "layers": args.layers, "global_batch": 32, "micro_batches": m,
                     "world": args.world, "threads_per_rank": 1, "optimizer": "AdamW", "rounds": args.rounds}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
