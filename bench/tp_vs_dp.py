"""Wide MLP on 2 processes: DATA_PARALLEL vs Megatron column/row tensor parallel (SEMI_AUTO_PARALLEL), interleaved.

Reports steady step time, images/s, peak RSS and parameter memory per rank (JSON).

    python bench/tp_vs_dp.py [--hidden 4096] [--layers 4] [--rounds 2]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="autopar-tp-"))
    rows: dict[str, list[list[dict]]] = {"dp": [], "tp": []}
    for rnd in range(args.rounds):
        for mode in rows:
            logs = tmp / f"{mode}-{rnd}"
            logs.mkdir()
            cmd = [sys.executable, "-m", "autopar.cli.main", "launch", "-n", "2", "--log-dir", str(logs),
                   str(WORK / "mlp_parallel.py"), "--mode", mode, "--hidden", str(args.hidden), "--layers",
                   str(args.layers), "--batch", str(args.batch), "--steps", str(args.steps)]
            rows[mode].append(_run(cmd, 1, logs))
            print(f"[bench] round {rnd + 1} {mode}: {max(r['steady_step_s'] for r in rows[mode][-1]):.3f} s/step",
                  file=sys.stderr, flush=True)
    out = {}
    for mode, runs in rows.items():
        out[f"mlp_{mode}"] = {
            "steady_step_s": round(statistics.median(max(r["steady_step_s"] for r in rs) for rs in runs), 4),
            "samples_per_s": round(statistics.median(min(r["images_per_s"] for r in rs) for rs in runs), 2),
            "peak_rss_mb_per_rank": round(statistics.median(max(r["peak_rss_mb"] for r in rs) for rs in runs), 1),
            "param_mb_per_rank": runs[0][0]["param_mb_per_rank"],
        }
    out["speedup_tp_vs_dp"] = round(out["mlp_dp"]["steady_step_s"] / out["mlp_tp"]["steady_step_s"], 3)
    out["config"] = {"hidden": args.hidden, "layers": args.layers, "batch_per_rank": args.batch, "world": 2,
                     "threads_per_rank": 1}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
