"""Sharded initialisation on real ranks: a GPT whose full parameters are more than a rank should hold, trained with
ZeRO-3 on 2 and 4 CPU ranks, built eagerly (every rank builds it whole, then shards it) vs under
``autopar.deferred_init`` (every rank makes only its shards, from the same seed's values), interleaved over rounds.
Per configuration (medians over rounds, the largest rank): peak RSS after the build, after the first step (setting
up done) and at the end, as a multiple of the network's full parameter bytes; seconds to build and to the first
step's end. ``--mode auto``: the same under AUTO_PARALLEL with ``--max-device-memory`` below what data parallel
needs, so its plan splits the network (a meta-built one is planned without being made: the setup this measures).

    python bench/sharded_init.py [--rounds 2] [--layers 8] [--hidden 1536] [--out bench/results/sharded_init.json]
    python bench/sharded_init.py --mode auto --max-device-memory 1GB --out bench/results/sharded_init_auto.json
    python bench/sharded_init.py --rank-memory 1.0 --layers 96 --hidden 1024 --vocab 8192 --worlds 4 --rounds 1 \
        --steps 2 --out bench/results/sharded_init_capped_4ranks.json
    python bench/sharded_init.py --builds deferred --malloc 1 lean --worlds 2 --steps 4 \
        --out bench/results/sharded_init_malloc.json

``--rank-memory X`` caps every rank's memory at X times the network's full parameter bytes (a cgroup per rank, the
kernel kills a rank that needs more: ``bench/rank_memory.py``): below 1, a rank may not hold the network whole.
``--malloc`` is the jobs' ``AUTOPAR_MALLOC`` (``lean``, the default here: freed blocks handed back to the kernel,
so a rank's resident set is what its tensors hold; ``1`` is the library's default, which keeps them).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "scripts"))
import rank_memory  # noqa: E402
from dp_throughput import _run  # noqa: E402

WORKER = Path(__file__).resolve().parent / "workloads" / "sharded_init.py"
KEYS = ("rss_after_build_mib", "rss_after_first_step_mib", "rss_peak_mib", "build_s", "to_first_step_s",
        "steady_step_s")


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
    p.add_argument("--rank-memory", type=float, default=None,
                   help="cap every rank's memory at this multiple of the network's full parameter bytes")
    p.add_argument("--malloc", nargs="+", default=["lean"],
                   help="the jobs' AUTOPAR_MALLOC (lean, 1 or 0); several: each a job of its own, interleaved")
    p.add_argument("--builds", nargs="+", choices=("eager", "deferred"), default=["eager", "deferred"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    full_bytes = _full_parameter_bytes(args)
    extra_env = {}
    if args.rank_memory is not None:
        extra_env[rank_memory.ENV] = str(int(args.rank_memory * full_bytes))
        print(f"every rank capped at {args.rank_memory} x the network's {full_bytes / 2**20:.0f} MiB of parameters",
              flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="autopar-sharded-init-"))
    runs: dict[str, list[list[dict]]] = {}
    failed: dict[str, str] = {}
    for rnd in range(args.rounds):
        for world in args.worlds:
            jobs = [(b, m) for b in args.builds for m in args.malloc]
            for build, malloc in jobs if rnd % 2 == 0 else jobs[::-1]:
                key = f"{build}@{world}" + (f" malloc={malloc}" if len(args.malloc) > 1 else "")
                logs = tmp / f"{build}-{world}-{malloc}-{rnd}"
                cmd = [sys.executable, "-m", "autopar.cli.main", "launch", "-n", str(world), "--log-dir", str(logs),
                       str(WORKER), build, str(args.layers), str(args.hidden), str(args.vocab), str(args.seq),
                       str(args.steps), args.mode, args.max_device_memory]
                # a first run's setup: nothing planned or timed before (AUTO's decisions and operator timings are
                # cached between runs of a job)
                try:
                    rows = _run(cmd, max(1, 2 // world), logs,
                                extra_env | {"AUTOPAR_MALLOC": malloc,
                                             "AUTOPAR_CACHE_DIR": str(tmp / f"cache-{build}-{world}-{malloc}-{rnd}")})
                except SystemExit as exc:  # (eager AUTO on 4 ranks: killed for memory on a 24 GiB host)
                    lines = str(exc).splitlines()
                    failed[key] = " -- ".join([lines[0].split(":")[0]] + [ln for ln in lines if "error:" in ln][:1])
                    print(f"round {rnd + 1} {key}: {failed[key]}", flush=True)
                    continue
                finally:
                    rank_memory.remove()
                runs.setdefault(key, []).append(rows)
                worst = max(rows, key=lambda r: r["rss_peak_mib"])
                print(f"round {rnd + 1} {key}: peak RSS {worst['rss_peak_mib']:.0f} MiB per rank "
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
           "full_param_mib": round(full_bytes / 2**20, 1), "malloc": args.malloc,
           "rank_memory_mib": None if args.rank_memory is None else round(args.rank_memory * full_bytes / 2**20, 1),
           "mode": args.mode, "max_device_memory": args.max_device_memory if args.mode == "auto" else None,
           "rounds": args.rounds, "summary": summary, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


def _full_parameter_bytes(args) -> int:
    """The network's full parameter bytes, counted on the meta device (nothing is allocated)."""
    import torch
    from gpt import GPT, GPTConfig

    config = GPTConfig(block_size=args.seq, vocab_size=args.vocab, n_layer=args.layers,
                       n_head=max(1, args.hidden // 64), n_embd=args.hidden)
    with torch.device("meta"):
        return sum(p.numel() * p.element_size() for p in GPT(config).parameters())


if __name__ == "__main__":
    main()
