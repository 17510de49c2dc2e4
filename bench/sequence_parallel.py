"""What sequence and context parallelism save, by the dry run's tracker: a nanoGPT-style GPT (4 layers, hidden 512,
vocabulary 8192, sequence 1024, batch 1; tests/scripts/dryrun_gpt.py).

- Sequence parallelism: Megatron's tensor parallelism on 2 and 4 simulated ranks under Megatron's data contract
  (every rank the same sequence: ``full_batch``), with and without the norms and dropouts split on the sequence
  (modes semi_megatron / semi_megatron_sp), against one rank. The GPT's head is not split by these plans (whole
  logits on every rank), so the SP rows are also run with a vocabulary of 256, where the layers are what is left.
- Context parallelism: the sequence split over 2 and 4 ranks (mode cp: keys and values all-gathered; cp_ring: passed
  round a ring) against the same job on one rank.

Per case: rank 0's training-step peak and its parts. Deterministic (the tracker counts bytes), so one round.

    python bench/sequence_parallel.py [--out bench/results/sequence_parallel.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests", "scripts", "dryrun_gpt.py")
GPT = ["4", "512", "8192", "1024", "1", "eager", "full_batch"]
SMALL_HEAD = GPT[:2] + ["256"] + GPT[3:]
MiB = 2**20


def step_peak(mode: str, world: int, gpt: list = GPT) -> dict:
    gpt = gpt if mode.startswith("semi") else gpt[:-1]  # full_batch: Megatron's tensor-parallel contract
    with tempfile.TemporaryDirectory() as logs:
        res = subprocess.run([sys.executable, "-m", "autopar.cli.main", "launch", "--dry-run", "-n", str(world),
                              "--log-dir", logs, SCRIPT, mode, *gpt], capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"{mode} on {world}: {res.stderr.strip()[-2000:]}")
        return json.load(open(os.path.join(logs, "dryrun.json")))["ranks"]["0"]["steady"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = {}
    for mode, world in [("semi_megatron", 2), ("semi_megatron_sp", 2), ("semi_megatron", 4), ("semi_megatron_sp", 4),
                        ("cp", 1), ("cp", 2), ("cp", 4), ("cp_ring", 2), ("cp_ring", 4)]:
        step = step_peak(mode, world)
        rows[f"{mode}@{world}"] = {k: step[k] for k in ("peak_bytes", "parameters", "gradients", "optimizer",
                                                         "activations", "other")}
        print(f"{mode:17s} on {world}: step peak {step['peak_bytes'] / MiB:7.2f} MiB, activations "
              f"{step['activations'] / MiB:7.2f} MiB, other {step['other'] / MiB:6.2f} MiB", flush=True)
    for mode, world in [("cp", 1), ("semi_megatron", 2), ("semi_megatron_sp", 2), ("semi_megatron", 4),
                        ("semi_megatron_sp", 4)]:  # the vocabulary of 256: the layers' activations
        step = step_peak(mode, world, SMALL_HEAD)
        rows[f"{mode}@{world}/vocab256"] = {k: step[k] for k in ("peak_bytes", "parameters", "gradients", "optimizer",
                                                                 "activations", "other")}
        print(f"{mode:17s} on {world}, vocabulary 256: step peak {step['peak_bytes'] / MiB:7.2f} MiB, activations "
              f"{step['activations'] / MiB:7.2f} MiB", flush=True)
    for world in (2, 4):
        tp, sp = rows[f"semi_megatron@{world}"], rows[f"semi_megatron_sp@{world}"]
        print(f"tp {world}: sequence parallelism keeps {sp['activations'] / tp['activations']:.3f} of the "
              f"activations, {sp['peak_bytes'] / tp['peak_bytes']:.3f} of the step's peak")
        one, tp, sp = (rows[f"{m}@{w}/vocab256"] for m, w in (("cp", 1), ("semi_megatron", world),
                                                                ("semi_megatron_sp", world)))
        print(f"tp {world}, vocabulary 256: of one rank's activations, tensor parallelism keeps "
              f"{tp['activations'] / one['activations']:.3f}, with sequence parallelism "
              f"{sp['activations'] / one['activations']:.3f} (1/{world} = {1 / world:.3f})")
    one = rows["cp@1"]
    for world in (2, 4):
        cp = rows[f"cp@{world}"]
        print(f"cp {world}: context parallelism keeps {cp['activations'] / one['activations']:.3f} of one rank's "
              f"activations, {cp['peak_bytes'] / one['peak_bytes']:.3f} of its step's peak")
        ring = rows[f"cp_ring@{world}"]
        print(f"cp {world}: as a ring, {ring['activations'] / one['activations']:.3f} of the activations, "
              f"{ring['peak_bytes'] / one['peak_bytes']:.3f} of the peak ({ring['peak_bytes'] / cp['peak_bytes']:.3f}"
              f" of the all-gather's)")
    if args.out:
        json.dump({"gpt": dict(zip(("n_layer", "n_embd", "vocab", "block", "batch"), map(int, GPT[:5]))),
                   "cases": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
