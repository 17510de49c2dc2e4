"""autopar DATA_PARALLEL vs plain torch DDP on the same workload, interleaved in one run (prints JSON).

ResNet-50 (the tutorial's), 32x32, batch 32 per worker, SGD momentum:
- ``autopar_dp``   : ``autopar launch -n 2`` of the tutorial path (Cifar10Dataset pipeline + Model.train), 1 thread
                     per worker (the launcher's default on 2 cores);
- ``torch_ddp``    : ``torchrun --nproc-per-node 2`` of a hand-written DDP loop on in-memory batches, 1 thread each;
- ``torch_single`` : one process with 2 threads (the scaling baseline);
- ``data_pipeline``: the autopar input pipeline alone, one process (its rate must exceed training's by >= 5x).
Configurations alternate round by round, so machine noise hits all of them alike; medians over rounds.

    python bench/dp_throughput.py [--rounds 2] [--steps 40] [--image-size 32]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = HERE / "workloads"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], threads: int, log_dir: Path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), BENCH_T0=repr(time.time()), PYTHONUNBUFFERED="1")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    text = res.stdout + res.stderr
    for log in sorted(log_dir.glob("worker_*.log")):
        text += log.read_text()
    rows = [json.loads(m) for m in re.findall(r"^BENCH (\{.*\})$", text, flags=re.M)]
    if res.returncode != 0 or not rows:
        raise SystemExit(f"benchmark run failed ({res.returncode}): {' '.join(cmd)}\n{text[-3000:]}")
    return rows


def _summary(rows_by_round: list[list[dict]]) -> dict:
    per_round = []
    for rows in rows_by_round:
        per_round.append({
            "images_per_s": min(r["images_per_s"] for r in rows),  # the slowest rank sets the pace
            "steady_step_s": max(r["steady_step_s"] for r in rows),
            "launch_to_first_step_s": max(r["launch_to_first_step_s"] for r in rows),
            "peak_rss_mb_per_process": max(r["peak_rss_mb"] for r in rows),
        })
    return {k: round(statistics.median(p[k] for p in per_round), 4) for k in per_round[0]} | {
        "rounds": [round(p["images_per_s"], 2) for p in per_round], "world": rows_by_round[0][0]["world"],
        "threads_per_process": rows_by_round[0][0]["threads"]}


def pipeline_rate(data: str, image_size: int, batches: int = 60) -> float:
    code = (
        "import time,sys; from autopar.train.recipes.resnet_cifar import create_dataset\n"
        "import autopar.comm as C; C.init()\n"
        f"ds = create_dataset({data!r}, 32, {image_size}); it = iter(ds.iter_epoch(0)); next(it)\n"
        f"t = time.perf_counter(); n = 0\n"
        f"for i in range({batches}): n += next(it)[0].shape[0]\n"
        "print('RATE', n / (time.perf_counter() - t))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    return float(re.search(r"RATE ([\d.]+)", out.stdout).group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image-size", type=int, default=32)
    args = p.parse_args()
    from autopar.dataset.synth import write_synthetic_cifar10

    tmp = Path(tempfile.mkdtemp(prefix="autopar-bench-"))
    data = str(write_synthetic_cifar10(tmp / "data").parent)
    common = ["--data", data, "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
              "--image-size", str(args.image_size)]
    results: dict[str, list[list[dict]]] = {"autopar_dp": [], "torch_ddp": [], "torch_single": []}
    for rnd in range(args.rounds):
        for name in results:
            logs = tmp / f"{name}-{rnd}"
            logs.mkdir()
            if name == "autopar_dp":
                cmd = [sys.executable, "-m", "autopar.cli.main", "launch", "-n", "2", "--log-dir", str(logs),
                       str(WORK / "autopar_dp.py"), *common]
                threads = 1
            elif name == "torch_ddp":
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                       str(_port()), str(WORK / "torch_ddp.py"), *common]
                threads = 1
            else:
                cmd = [sys.executable, str(WORK / "torch_ddp.py"), *common]
                threads = 2
            results[name].append(_run(cmd, threads, logs))
            print(f"[bench] round {rnd + 1} {name}: {min(r['images_per_s'] for r in results[name][-1]):.1f} images/s",
                  file=sys.stderr, flush=True)
    summary = {name: _summary(rows) for name, rows in results.items()}
    train_rate = summary["autopar_dp"]["images_per_s"]
    pipe = pipeline_rate(data, args.image_size)
    summary["data_pipeline"] = {"images_per_s": round(pipe, 1), "vs_training_rate": round(pipe / train_rate, 2)}
    summary["ratio_autopar_vs_torch_ddp"] = round(train_rate / summary["torch_ddp"]["images_per_s"], 4)
    summary["config"] = {"model": "resnet50 (tutorial)", "image_size": args.image_size, "batch_per_worker": args.batch,
                         "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
