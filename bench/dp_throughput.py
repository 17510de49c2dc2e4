"""autopar DATA_PARALLEL vs plain torch DDP on the same workload, interleaved in one run (prints JSON).

ResNet-50 (the tutorial's), 32x32, batch 32 per worker, SGD momentum, 2 workers x 1 thread:
- ``autopar_dp``     : ``autopar launch -n 2`` of the tutorial path (Cifar10Dataset pipeline + Model.train) with
                       autopar's defaults;
- ``autopar_nocomm`` : the same, each rank stand-alone (no gradient all-reduce): its difference is the exposed
                       communication;
- ``torch_ddp``      : ``torchrun`` of a hand-written DDP loop on in-memory batches (plain DDP, torch's defaults);
- ``torch_nocomm``   : the same processes without DDP: pure compute;
- ``torch_nocomm_tuned``: that hand loop with autopar's speed defaults applied (``parallel.tuning``): autopar's
                       compute, the baseline of the split;
- ``torch_single``   : one process with 2 threads (the scaling baseline);
- optional ``autopar_dp_graph`` (``--graph-mode``, torch.compile), ``autopar_dp_O1`` (``--amp-level O1``) and
  ``autopar_dp_no_<lever>`` (``--ablate malloc``: that lever of ``parallel.tuning`` switched off);
- ``data_pipeline``  : the autopar input pipeline alone, one process.
Also: the split of an autopar step (compute / exposed communication / data / framework), the issue's targets,
and rank 0's per-step loss curve. Configurations alternate round by round; medians over rounds.

    python bench/dp_throughput.py [--rounds 3] [--steps 40] [--image-size 32] [--graph-mode] [--amp-level O1]
                                  [--ablate malloc] [--ablate small_conv]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autopar.cluster.netutil import free_port

HERE = Path(__file__).resolve().parent
WORK = HERE / "workloads"


def _run(cmd: list[str], threads: int, log_dir: Path, extra_env: dict[str, str] | None = None) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), BENCH_T0=repr(time.time()), PYTHONUNBUFFERED="1",
               **(extra_env or {}))
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
            "pss_mb_per_process_at_end": max(r.get("pss_mb") or 0.0 for r in rows),
            "cpu_per_step_s": max(r.get("cpu_step_s", float("nan")) for r in rows),
            "system_cpu_per_step_s": max(r.get("system_step_s", float("nan")) for r in rows),
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


def _autopar(logs: str, common: list[str]) -> list[str]:
    return [sys.executable, "-m", "autopar.cli.main", "launch", "-n", "2", "--log-dir", logs,
            str(WORK / "autopar_dp.py"), *common]


def _torchrun(common: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "0",
            str(WORK / "torch_ddp.py"), *common]


def _split(summary: dict, results: dict) -> dict:
    """Where an autopar step goes: compute (the hand loop with autopar's levers, no gradient sync), exposed
    communication (the difference the all-reduce makes), waiting for data (measured in the loop), and the rest of
    the framework (Model loop, callbacks, input pipeline thread)."""
    step = summary["autopar_dp"]["steady_step_s"]
    nocomm = summary["autopar_nocomm"]["steady_step_s"]
    waits = [r["data_wait_s"] for rows in results["autopar_dp"] for r in rows if r.get("data_wait_s") is not None]
    data = statistics.median(waits) if waits else 0.0
    compute = summary["torch_nocomm_tuned"]["steady_step_s"]
    torch_compute = summary["torch_nocomm"]["steady_step_s"]
    return {
        "step_s": round(step, 4),
        "compute_s": round(compute, 4),
        "torch_compute_s": round(torch_compute, 4),
        "communication_exposed_s": round(step - nocomm, 4),
        "data_wait_s": round(data, 4),
        "framework_s": round(nocomm - compute - data, 4),
        "communication_exposed_pct": round(100 * (step - nocomm) / step, 2),
        "torch_ddp_communication_exposed_pct": round(
            100 * (summary["torch_ddp"]["steady_step_s"] - torch_compute) / summary["torch_ddp"]["steady_step_s"], 2),
    }


def _targets(summary: dict) -> dict:
    """The speed issues' targets: >= 1.5x plain DDP's images/s, exposed communication <= 5 % of a step, and, with
    ``--ablate shared_memory`` (the same job on gloo, in the same run), the all-reduce's CPU per rank halved --
    measured in the training job: CPU per step with communication minus without."""
    a, t = summary["autopar_dp"], summary["torch_ddp"]
    ratio = a["images_per_s"] / t["images_per_s"]
    launch = a["launch_to_first_step_s"] - t["launch_to_first_step_s"]
    memory = a["peak_rss_mb_per_process"] / t["peak_rss_mb_per_process"] - 1
    out = {
        "speed_vs_torch_ddp": round(ratio, 3), "speed_target_1.5x_met": ratio >= 1.5,
        "communication_exposed_pct": summary["split"]["communication_exposed_pct"],
        "communication_exposed_at_most_5pct": summary["split"]["communication_exposed_pct"] <= 5.0,
        "launch_extra_s": round(launch, 2), "launch_within_1s": launch <= 1.0,
        "memory_extra_pct": round(100 * memory, 1), "memory_within_5pct": memory <= 0.05,
    }
    gloo = summary.get("autopar_dp_no_shared_memory")
    if gloo:
        nocomm_cpu = summary["autopar_nocomm"]["cpu_per_step_s"]
        shm_cpu, gloo_cpu = a["cpu_per_step_s"] - nocomm_cpu, gloo["cpu_per_step_s"] - nocomm_cpu
        out |= {
            "speed_vs_autopar_on_gloo": round(a["images_per_s"] / gloo["images_per_s"], 3),
            "allreduce_cpu_per_step_s_shared_memory": round(shm_cpu, 4),
            "allreduce_cpu_per_step_s_gloo": round(gloo_cpu, 4),
            "allreduce_cpu_halved": shm_cpu <= gloo_cpu / 2,
            "memory_vs_gloo_pss_pct": round(100 * (a["pss_mb_per_process_at_end"]
                                                   / gloo["pss_mb_per_process_at_end"] - 1), 1),
            "memory_vs_gloo_peak_rss_pct": round(100 * (a["peak_rss_mb_per_process"]
                                                        / gloo["peak_rss_mb_per_process"] - 1), 1),
            "launch_vs_gloo_s": round(a["launch_to_first_step_s"] - gloo["launch_to_first_step_s"], 2),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--graph-mode", action="store_true", help="also run autopar in GRAPH_MODE (torch.compile)")
    p.add_argument("--amp-level", default="O0", help="also run autopar at this amp_level (O1/O2)")
    p.add_argument("--ablate", action="append", default=[], metavar="LEVER",
                   help="also run autopar_dp with AUTOPAR_<LEVER>=0 (e.g. malloc, small_conv, fused_optimizer)")
    args = p.parse_args()
    from autopar.dataset.synth import write_synthetic_cifar10

    tmp = Path(tempfile.mkdtemp(prefix="autopar-bench-"))
    data = str(write_synthetic_cifar10(tmp / "data").parent)
    common = ["--data", data, "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
              "--image-size", str(args.image_size)]
    logs_placeholder = "{logs}"  # each run's own log folder, filled in per round
    configs: dict[str, tuple[list[str], int, dict[str, str]]] = {
        "autopar_dp": (_autopar(logs_placeholder, common), 1, {}),
        "autopar_nocomm": (_autopar(logs_placeholder, common + ["--no-comm"]), 1, {}),
        "torch_ddp": (_torchrun(common), 1, {}),
        "torch_nocomm": (_torchrun(common + ["--no-ddp"]), 1, {}),
        "torch_nocomm_tuned": (_torchrun(common + ["--no-ddp", "--autopar-levers"]), 1, {}),
        "torch_single": ([sys.executable, str(WORK / "torch_ddp.py"), *common], 2, {}),
    }
    if args.graph_mode:
        configs["autopar_dp_graph"] = (_autopar(logs_placeholder, common + ["--graph-mode"]), 1, {})
    if args.amp_level != "O0":
        configs[f"autopar_dp_{args.amp_level}"] = (
            _autopar(logs_placeholder, common + ["--amp-level", args.amp_level]), 1, {})
    for lever in args.ablate:
        configs[f"autopar_dp_no_{lever}"] = (_autopar(logs_placeholder, common), 1, {f"AUTOPAR_{lever.upper()}": "0"})
    results: dict[str, list[list[dict]]] = {name: [] for name in configs}
    for rnd in range(args.rounds):
        for name, (cmd, threads, extra_env) in configs.items():
            logs = tmp / f"{name}-{rnd}"
            logs.mkdir()
            cmd = [c.replace("{logs}", str(logs)) for c in cmd]
            if "--master-port" in cmd:
                cmd[cmd.index("--master-port") + 1] = str(free_port())
            results[name].append(_run(cmd, threads, logs, extra_env))
            print(f"[bench] round {rnd + 1} {name}: {min(r['images_per_s'] for r in results[name][-1]):.1f} images/s",
                  file=sys.stderr, flush=True)
    summary = {name: _summary(rows) for name, rows in results.items()}
    train_rate = summary["autopar_dp"]["images_per_s"]
    pipe = pipeline_rate(data, args.image_size)
    summary["data_pipeline"] = {"images_per_s": round(pipe, 1), "vs_training_rate": round(pipe / train_rate, 2)}
    summary["split"] = _split(summary, results)
    summary["targets"] = _targets(summary)
    rank0 = [r for r in results["autopar_dp"][0] if r["rank"] == 0][0]
    summary["loss_curve"] = {"autopar_dp_rank0": rank0.get("losses"),
                             "mindspore": "not importable here: run bench/dp_throughput.py where mindspore is installed"
                             if importlib.util.find_spec("mindspore") is None else
                             "importable, but the side-by-side MindSpore run is not automated yet"}
    summary["config"] = {"model": "resnet50 (tutorial)", "image_size": args.image_size, "batch_per_worker": args.batch,
                         "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
