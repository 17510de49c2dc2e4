"""Sharded initialisation on real ranks: a GPT whose full parameters are more than a rank should hold, trained with
ZeRO-3 on 2 and 4 CPU ranks, built eagerly (every rank builds it whole, then shards it) vs under
``autopar.deferred_init`` (every rank makes only its shards, from the same seed's values), interleaved over rounds.
Per configuration (medians over rounds, the largest rank): peak RSS after the build, after the first step (setting
up done) and at the end, as a multiple of the network's full parameter bytes; seconds to build and to the first
step's end. ``--mode auto``: the same under AUTO_PARALLEL with ``--max-device-memory`` below what data parallel
needs, so its plan splits the network (a meta-built one is planned without being made: the setup this measures).

    python bench/sharded_init.py [--rounds 2] [--layers 8] [--hidden 1536] [--out bench/results/sharded_init.json]
    python bench/sharded_init.py --mode auto --max-device-memory 1GB --out bench/results/sharded_init_auto.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dp_throughput import _run  # noqa: E402

WORKER = Path(__file__).resolve().parent / "workloads" / "sharded_init.py"
KEYS = ("rss_after_build_mib", "rss_after_first_step_mib", "rss_peak_mib", "build_s", "to_first_step_s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--mode", choices=("zero3", "auto"), default="zero3",
                   help="ZeRO-3, or AUTO_PARALLEL with --max-device-memory (which data parallel must not fit)")
    p.add_argument("--max-device-memory", default="1GB")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="autopar-sharded-init-"))
    runs: dict[str, list[list[dict]]] = {}
    failed: dict[str, str] = {}
    for rnd in range(args.rounds):
        for world in args.worlds:
            for build in ("eager", "deferred") if rnd % 2 == 0 else ("deferred", "eager"):
                logs = tmp / f"{build}-{world}-{rnd}"
                cmd = [sys.executable, "-m", "autopar.cli.main", "launch", "-n", str(world), "--log-dir", str(logs),
                       str(WORKER), build, str(args.layers), str(args.hidden), str(args.vocab), str(args.seq),
                       str(args.steps), args.mode, args.max_device_memory]
                # a first run's setup: nothing planned or timed before (AUTO's decisions and operator timings are
                # cached between runs of a job)
                try:
                    rows = _run(cmd, max(1, 2 // world), logs,
                                {"AUTOPAR_CACHE_DIR": str(tmp / f"cache-{build}-{world}-{rnd}")})
                except SystemExit as exc:  # (eager AUTO on 4 ranks: killed for memory on a 24 GiB host)
                    lines = str(exc).splitlines()
                    failed[f"{build}@{world}"] = " -- ".join([lines[0].split(":")[0]]
                                                            + [ln for ln in lines if "error:" in ln][:1])
                    print(f"round {rnd + 1} {build}@{world}: {failed[f'{build}@{world}']}", flush=True)
                    continue
                runs.setdefault(f"{build}@{world}", []).append(rows)
                worst = max(rows, key=lambda r: r["rss_peak_mib"])
                print(f"round {rnd + 1} {build}@{world}: peak RSS {worst['rss_peak_mib']:.0f} MiB per rank "
                      f"(full parameters {worst['full_param_mib']:.0f} MiB), first step after "
                      f"{worst['to_first_step_s']:.1f} s", flush=True)
    summary = {}
    for key, rounds in runs.items():
        full = rounds[0][0]["full_param_mib"]
        row = {k: statistics.median(max(r[k] for r in rows) for rows in rounds) for k in KEYS}
        row |= {f"{k}_over_full": row[k] / full for k in KEYS if k.startswith("rss")}
        summary[key] = {"full_param_mib": full, **{k: round(v, 3) for k, v in row.items()},
                        "plan": sorted({r.get("plan", "zero3") for rows in rounds for r in rows})}
    for world in args.worlds:
        e, d = summary.get(f"eager@{world}"), summary.get(f"deferred@{world}")
        if e and d:
            summary[f"deferred_over_eager_peak@{world}"] = round(d["rss_peak_mib"] / e["rss_peak_mib"], 3)
    summary |= {f"{key} failed": why for key, why in failed.items()}
    out = {"model": {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "seq": args.seq},
           "mode": args.mode, "max_device_memory": args.max_device_memory if args.mode == "auto" else None,
           "rounds": args.rounds, "summary": summary, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
