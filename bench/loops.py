"""The PyTorch door's speed: one hand-written loop as plain DDP, as autopar's plain loop, and through Model.train.

Interleaved in one run, round by round (medians over rounds), 2 workers x 1 thread, batch 32 per worker:

- ``torch_ddp``       : torchrun + DDP (the baseline of every ratio);
- ``autopar_plain``   : ``autopar launch -n 2``, the same loop with only the DATA_PARALLEL context and ``init()``;
- ``autopar_model``   : the same network, optimizer and batches through ``Model.train``;
- ``autopar_plain_gloo``: ``autopar_plain`` with ``AUTOPAR_SHARED_MEMORY=0`` (the bucketed engine on gloo);
- ``nocomm``          : the same processes training alone (compute only: the floor);
- with ``--before SRC`` (another checkout's ``src``, e.g. a git worktree of an earlier commit): ``before_plain`` and
  ``before_model``, the same two autopar loops on that code -- "no slower than before", measured in the same run.

    python bench/loops.py [--rounds 3] [--steps 40] [--net torchvision|tutorial] [--before OLD/src] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from dp_throughput import _run, _summary

from autopar.cluster.netutil import free_port

HERE = Path(__file__).resolve().parent
WORK = HERE / "workloads" / "loops.py"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--net", choices=["torchvision", "tutorial"], default="torchvision")
    p.add_argument("--before", help="an earlier checkout's src directory: its plain loop and Model.train, interleaved")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    from autopar.dataset.synth import write_synthetic_cifar10

    tmp = Path(tempfile.mkdtemp(prefix="autopar-loops-"))
    data = str(write_synthetic_cifar10(tmp / "data").parent)
    common = ["--data", data, "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
              "--image-size", str(args.image_size), "--net", args.net]

    def launch(logs: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "autopar.cli.main", "launch", "-n", "2", "--log-dir", logs, str(WORK), *common,
                *extra]

    def torchrun(*extra: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "{port}",
                str(WORK), *common, *extra]

    configs = {
        "torch_ddp": (torchrun("--engine", "ddp"), {}),
        "autopar_plain": (launch("{logs}", "--engine", "autopar"), {}),
        "autopar_model": (launch("{logs}", "--engine", "autopar", "--loop", "model"), {}),
        "autopar_plain_gloo": (launch("{logs}", "--engine", "autopar"), {"AUTOPAR_SHARED_MEMORY": "0"}),
        "nocomm": (torchrun("--engine", "none"), {}),
    }
    if args.before:
        import os

        old = {"PYTHONPATH": os.path.abspath(args.before)}
        configs["before_plain"] = (launch("{logs}", "--engine", "autopar"), old)
        configs["before_model"] = (launch("{logs}", "--engine", "autopar", "--loop", "model"), old)
    results: dict[str, list] = {name: [] for name in configs}
    engines: dict[str, str] = {}
    for rnd in range(args.rounds):
        for name, (cmd, env) in configs.items():
            logs = tmp / f"{name}-{rnd}"
            logs.mkdir()
            cmd = [c.replace("{logs}", str(logs)).replace("{port}", str(free_port())) for c in cmd]
            rows = _run(cmd, 1, logs, env)
            results[name].append(rows)
            engines[name] = rows[0].get("engine", "")
            print(f"[bench] round {rnd + 1} {name}: {min(r['images_per_s'] for r in rows):.1f} images/s",
                  file=sys.stderr, flush=True)
    summary = {name: _summary(rows) | ({"engine": engines[name]} if engines[name] else {})
               for name, rows in results.items()}
    ddp = summary["torch_ddp"]["images_per_s"]
    plain, model = summary["autopar_plain"]["images_per_s"], summary["autopar_model"]["images_per_s"]
    per_round = [a / b for a, b in zip(summary["autopar_plain"]["rounds"], summary["torch_ddp"]["rounds"])]
    summary["ratios"] = {
        "plain_vs_torch_ddp": round(plain / ddp, 3), "plain_vs_torch_ddp_per_round": [round(r, 3) for r in per_round],
        "model_vs_torch_ddp": round(model / ddp, 3), "plain_vs_model": round(plain / model, 3),
        "plain_gloo_vs_torch_ddp": round(summary["autopar_plain_gloo"]["images_per_s"] / ddp, 3),
        "target_plain_at_least_1.5x_ddp": plain / ddp >= 1.5,
    }
    if args.before:
        summary["ratios"]["plain_vs_before_plain"] = round(plain / summary["before_plain"]["images_per_s"], 3)
        summary["ratios"]["model_vs_before_model"] = round(model / summary["before_model"]["images_per_s"], 3)
    summary["config"] = {"net": args.net, "image_size": args.image_size, "batch_per_worker": args.batch,
                         "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "workers": 2,
                         "threads_per_worker": 1}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
