"""Context parallelism's promise, measured on real ranks: a Hugging Face Llama trains on a sequence 4x longer than
one rank holds in the same memory, exactly as one process trains it.

A tiny ``LlamaForCausalLM`` (2 layers, 128 wide, 8 query heads over 4 key-value heads, float64, AdamW with clipping,
3 steps; ``bench/workloads/long_context.py``) on one sequence: one rank at S, 2S and 4S tokens, then 4S tokens
context parallel over 4 ranks (``dataset_strategy`` splits the sequence; each ``context_parallel_algo``). Memory is
each rank's peak of tensor bytes as the dry run's storage tracker counts it (the largest rank), beside peak RSS;
exactness is the largest difference in the losses and in the parameters after the last step against one rank at 4S.

    python bench/long_context.py [--seq 1024] [--world 4] [--algos ring all_gather ulysses]
                                 [--out bench/results/long_context.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

WORKER = Path(__file__).resolve().parent / "workloads" / "long_context.py"


def _run(world: int, algo: str, seq: int, tmp: Path) -> dict:
    out = tmp / f"{algo}-{world}-{seq}.json"
    cmd = [sys.executable, "-m", "autopar.cli.main", "launch", "-n", str(world), "--log-dir", str(tmp / out.stem),
           str(WORKER), algo, str(seq), str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0 or not out.exists():
        raise SystemExit(f"benchmark run failed ({res.returncode}): {' '.join(cmd)}\n{(res.stdout + res.stderr)[-3000:]}")
    row = json.loads(out.read_text())
    row["params"] = torch.load(str(out) + ".pt")
    peak = max(r["peak_bytes"] for r in row["ranks"])
    print(f"{algo} on {world} rank(s), sequence {seq}: peak {peak / 2**20:.1f} MiB of tensors per rank, "
          f"losses {['%.6f' % x for x in row['losses']]}", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=1024, help="S: what one rank trains; the long sequence is 4S")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--algos", nargs="+", default=["ring", "all_gather", "ulysses"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="autopar-long-context-"))
    long = args.world * args.seq
    one = {s: _run(1, "one", s, tmp) for s in (args.seq, 2 * args.seq, long)}
    budget = max(r["peak_bytes"] for r in one[args.seq]["ranks"])
    rows = {}
    for s, row in one.items():
        peak = max(r["peak_bytes"] for r in row["ranks"])
        rows[f"one rank, {s} tokens"] = {"peak_mib": round(peak / 2**20, 2), "of_one_rank_at_S": round(peak / budget, 3),
                                         "peak_rss_mib": round(max(r["peak_rss_mib"] for r in row["ranks"]), 1)}
    reference = one[long]
    for algo in args.algos:
        row = _run(args.world, algo, long, tmp)
        peak = max(r["peak_bytes"] for r in row["ranks"])
        loss_diff = max(abs(a - b) for a, b in zip(row["losses"], reference["losses"]))
        norm_diff = max(abs(a - b) for a, b in zip(row["grad_norms"], reference["grad_norms"]))
        diffs = {k: (row["params"][k] - v).abs().max().item() for k, v in reference["params"].items()}
        worst = max(diffs, key=diffs.get)
        param_diff = diffs[worst]
        rows[f"context parallel {args.world} ({algo}), {long} tokens"] = {
            "peak_mib": round(peak / 2**20, 2), "of_one_rank_at_S": round(peak / budget, 3),
            "peak_rss_mib": round(max(r["peak_rss_mib"] for r in row["ranks"]), 1),
            "per_rank_mib": [round(r["peak_bytes"] / 2**20, 2) for r in row["ranks"]],
            "max_loss_diff": loss_diff, "max_grad_norm_diff": norm_diff, "max_param_diff": param_diff, "worst_param": worst}
    result = {"model": "LlamaForCausalLM: 2 layers, hidden 128, 8 heads / 4 key-value heads, vocab 512, float64",
              "S": args.seq, "long_sequence": long, "world": args.world, "steps": 3, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
