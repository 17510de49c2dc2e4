"""The GPU check, one command for the day a device is lent (``bash bench/gpu_check.sh``; about 8 minutes on one GPU).

Steps, each under its own time limit, each recorded in one JSON (``bench/results/gpu_check.json``, or ``--out``):
  1. ``gpu_tests``: the suite's GPU-marked tests (``pytest -m gpu``: the simulated scripts trained for real, the dry
     run's predicted peak beside ``torch.cuda.max_memory_allocated``);
  2. ``readme_job``: the README's main job (``autopar train --synthetic``) on 1 GPU;
  3. ``resnet50``: the tutorial's ResNet-50 on CIFAR-10-shaped batches, 32x32 and 224x224, fp32 and bf16, eager and
     compiled: autopar's ``Model.train`` vs a hand-written torch loop, interleaved rounds, images/s;
  4. ``gpt``: a 124M GPT in DATA_PARALLEL, ZeRO-3 and AUTO on 1 GPU vs a plain torch loop, tokens/s;
  5. ``dryrun``: ``--dry-run --dry-run-device cuda`` of the GPT script: the predicted peak per rank (on the GPU the
     real peak is in step 1).
Without a GPU the GPU steps are recorded as skipped and the rest runs; ``rehearsal`` then runs one configuration of
each benchmark workload (steps 3 and 4) on simulated GPUs (``--dry-run-device cuda``): the code the GPU will run,
run through once (its numbers time fake tensors and mean nothing; its predicted peaks are kept).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "bench" / "workloads" / "gpu_models.py"
SCRIPT = ROOT / "tests" / "scripts" / "cuda_gpt.py"


def _autopar(*args: str) -> list[str]:
    return [sys.executable, "-m", "autopar.cli.main", *args]


def _run(cmd: list[str], limit: float, cwd: Path | None = None) -> dict:
    started = time.monotonic()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=cwd or ROOT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"over its {limit:.0f} s limit", "seconds": round(time.monotonic() - started, 1)}
    out = {"ok": res.returncode == 0, "seconds": round(time.monotonic() - started, 1)}
    if res.returncode:
        out["error"] = (res.stderr.strip().splitlines() or res.stdout.strip().splitlines() or ["no output"])[-1]
    out["stdout_tail"] = res.stdout.strip().splitlines()[-8:]
    return out


def _json_lines(step: dict) -> dict:
    """The workload's results by configuration (one JSON line each)."""
    out = {}
    for line in step.get("stdout_tail", []):
        if line.startswith("{"):
            result = json.loads(line)
            out[result.pop("config")] = result
    return out


def gpu_tests() -> dict:
    return _run([sys.executable, "-m", "pytest", "-q", "-s", "-m", "gpu", "tests"], 240)


def readme_job(log_dir: Path) -> dict:
    return _run(_autopar("train", "-n", "1", "--synthetic", "--synthetic-records", "1000", "--epochs", "1",
                         "--log-dir", str(log_dir)), 180)


RESNET = [(size, precision, how) for size in (32, 224) for precision in ("fp32", "bf16") for how in ("eager", "compiled")]


def _warm_compiles() -> dict:
    """The compiled configurations once each, 4 at a time, steps of 1: torch.compile's caches (FX graphs, AOT
    autograd) then serve the timed runs, whose compile is seconds instead of a minute each -- 8 cold compiles one
    after the other would spend the check's 8 minutes on the CPU."""
    started = time.monotonic()
    pending = [c for c in RESNET if c[2] == "compiled"]
    running: list = []
    failed = []
    while pending or running:
        while pending and len(running) < 4:
            size, precision, how = pending.pop(0)
            cmd = [sys.executable, str(WORKLOAD), "resnet", str(size), precision, how, "1", "1"]
            running.append((f"{size}px/{precision}", subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                                                      stderr=subprocess.DEVNULL)))
        label, proc = running.pop(0)
        try:
            if proc.wait(timeout=max(1.0, 300 - (time.monotonic() - started))):
                failed.append(label)
        except subprocess.TimeoutExpired:
            proc.kill()
            failed.append(f"{label} (over 300 s)")
    return {"seconds": round(time.monotonic() - started, 1), "failed": failed}


def resnet50(quick: bool) -> dict:
    results = {"warm_compiles": _warm_compiles()}
    rounds, steps = (2, 5) if quick else (3, 20)
    for how in ("eager", "compiled"):  # one process each: 4 configurations, one start-up
        step = _run([sys.executable, str(WORKLOAD), "resnet", "32,224", "fp32,bf16", how, str(rounds), str(steps)],
                    240)
        results[how] = {**step, "configs": _json_lines(step)}
    return results


def gpt(quick: bool) -> dict:
    results = {}
    for mode in ("data", "zero3", "auto"):
        rounds, steps = (2, 3) if quick else (3, 10)
        step = _run([sys.executable, str(WORKLOAD), "gpt", mode, "bf16", str(rounds), str(steps)], 150)
        results[mode] = {**step, **_json_lines(step).get(f"{mode}/bf16", {})}
    return results


def dryrun(log_dir: Path) -> dict:
    step = _run(_autopar("launch", "--dry-run", "--dry-run-device", "cuda", "-n", "2", "--log-dir", str(log_dir),
                         str(SCRIPT), "zero3", "bf16"), 120)
    report = log_dir / "dryrun.json"
    if report.exists():
        ranks = json.loads(report.read_text())["ranks"]
        step["predicted_peak_mib"] = {r: round(v["steady"]["peak_bytes"] / 2**20, 2) for r, v in ranks.items()
                                      if v.get("steady")}
    return step


def rehearsal(log_dir: Path) -> dict:
    results = {}
    for label, args in (("gpt/data/bf16", ["gpt", "data", "bf16", "1", "1"]),
                        ("resnet50/32px/bf16/eager", ["resnet", "32", "bf16", "eager", "1", "1"]),
                        ("resnet50/224px/fp32/compiled", ["resnet", "224", "fp32", "compiled", "1", "1"])):
        logs = log_dir / label.replace("/", "_")
        step = _run(_autopar("launch", "--dry-run", "--dry-run-device", "cuda", "--dry-run-steps", "100", "-n", "1",
                             "--log-dir", str(logs), str(WORKLOAD), *args), 240)
        log = logs / "dryrun_rank0.log"
        lines = [ln for ln in log.read_text().splitlines() if ln.startswith("{")] if log.exists() else []
        step["workload_ran"] = bool(lines)
        step["ok"] = step["ok"] and bool(lines)
        if lines:
            out = json.loads(lines[-1])
            step["predicted_peak_mib"] = {k: v for k, v in out.items() if k.endswith("_peak_mib")}
        results[label] = step
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_check.json"))
    p.add_argument("--quick", action="store_true", help="fewer rounds and steps (a first look)")
    a = p.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    work = ROOT / "autopar_logs" / "gpu_check"  # each step's logs (git-ignored)
    report: dict = {"device": torch.cuda.get_device_name() if gpu else None, "torch": torch.__version__,
                    "started": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": {}}
    steps = [("gpu_tests", gpu_tests, True), ("readme_job", lambda: readme_job(work / "readme"), True),
             ("resnet50", lambda: resnet50(a.quick), True), ("gpt", lambda: gpt(a.quick), True),
             ("dryrun", lambda: dryrun(work / "dryrun"), False)]
    if not gpu:
        steps.append(("rehearsal", lambda: rehearsal(work / "rehearsal"), False))
    for name, step, needs_gpu in steps:
        if needs_gpu and not gpu:
            report["steps"][name] = {"skipped": "no CUDA device here"}
        else:
            print(f"[gpu_check] {name} ...", flush=True)
            report["steps"][name] = step()
        print(f"[gpu_check] {name}: {json.dumps(report['steps'][name])[:300]}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    failed = [n for n, s in report["steps"].items() if _failed(s)]
    print(f"[gpu_check] {'failed: ' + ', '.join(failed) if failed else 'every step that ran passed'}; {a.out}")
    return 1 if failed else 0


def _failed(step: dict) -> bool:
    if "ok" in step:
        return not step["ok"]
    return any(isinstance(v, dict) and _failed(v) for v in step.values())


if __name__ == "__main__":
    sys.exit(main())
