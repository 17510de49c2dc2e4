"""Run MindSpore's 15 distributed samples on autopar, changed only where issue 29 allows, and report each result.

    python tools/ms_names.py --extract DOCS_GIT_DIR /tmp/ms_docs        # the samples, from the docs repository
    python tools/run_ms_samples.py /tmp/ms_docs [--only "data parallel"] [--markdown OUT.md]

Each sample's files (``tools/ms_samples.CORE``) are copied to a scratch directory and changed there, never here:

* imports: ``mindspore`` -> ``autopar`` in ``import``/``from`` lines (a bare ``import mindspore`` becomes
  ``import autopar as mindspore``);
* the device: ``device_target="Ascend"/"GPU"`` -> ``"CPU"``, ``init("nccl")``/``init(backend_name="hccl")`` ->
  ``init()``;
* less work: ``range(10)`` epochs and ``train(10, ...)`` / ``epoch_size=10`` -> 1, the CPU tutorial's 224x224
  resize -> 32x32;
* small synthetic data in the real formats (MNIST idx-ubyte, CIFAR-10 binary) in ``DATA_PATH``.

Samples whose code sits in ``test_*`` functions (run by pytest in MindSpore's scripts) get a two-line driver that
imports the file and calls them. A sample runs on ``autopar launch -n N`` with the device count its strategies
need (8 for the operator-parallel ones; a rank table of 127.0.0.1 for the r1.x rank-table samples). Reported per
sample: exit code, seconds, the last loss line and, on failure, the error line. These runs are a smoke test of the
door; the numerical checks (equal to one process) are the adaptations in ``tests/scripts/ms_*.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ms_samples import CORE  # noqa: E402

NPROC = {"operator parallel": 8, "sharding propagation": 8, "parallel quick start": 8,
         "r1.x operator parallel (rank table)": 8, "2.6 operator parallel (AutoParallel)": 8,
         "distributed inference": 8}
RANK_TABLE = {"r1.x operator parallel (rank table)", "distributed inference"}
# Samples whose run script starts rank i in its own folder device{i} (MindSpore's run.sh: ``mkdir device$i; cd
# device$i``) and whose later step reads ``../device{i}/...``: all ranks here share one folder, device0, and
# device1..N-1 are links to it.
DEVICE_FOLDERS = {"distributed inference"}
# the file to run (its neighbours are copied beside it); inference first trains, then predicts
ENTRY = {"CPU ResNet-50 tutorial (with its resnet.py)": ["resnet50_distributed_training.py"],
         "distributed inference": ["distributed_training.py", "distributed_inference.py"]}


def rewrite(text: str, gpu: bool = False) -> str:
    """``gpu``: the device stays a GPU (Ascend becomes one, HCCL becomes NCCL) -- for the simulated GPUs of
    ``--dry-run-device cuda``."""
    out = []
    for line in text.splitlines():
        stripped = line.lstrip()
        if re.match(r"(import|from)\s+mindspore\b", stripped):
            line = re.sub(r"^(\s*)import mindspore\s*$", r"\1import autopar as mindspore", line)
            line = re.sub(r"\bmindspore\b", "autopar", line) if "import autopar as mindspore" not in line else line
        line = re.sub(r"device_target\s*=\s*[\"'](Ascend|GPU)[\"']", f'device_target="{"GPU" if gpu else "CPU"}"', line)
        line = re.sub(r"\binit\(\s*(backend_name\s*=\s*)?[\"'](nccl|hccl)[\"']\s*\)", 'init("nccl")' if gpu else "init()",
                      line)
        line = re.sub(r"\brange\(10\)", "range(1)", line)
        line = re.sub(r"\.train\((epoch=)?10\s*,", r".train(\g<1>1,", line)
        line = re.sub(r"\bepoch_size=10\b", "epoch_size=1", line)
        line = re.sub(r"^(\s*resize_(height|width)\s*=\s*)224\s*$", r"\g<1>32", line)
        out.append(line)
    return "\n".join(out) + "\n"


def rank_table(path: Path, n: int) -> Path:
    devices = [{"device_id": str(i), "device_ip": f"192.98.92.{100 + i}", "rank_id": str(i)} for i in range(n)]
    table = {"version": "1.0", "server_count": "1", "status": "completed",
             "server_list": [{"server_id": "127.0.0.1", "device": devices, "host_nic_ip": "reserve"}]}
    path.write_text(json.dumps(table))
    return path


def make_data(where: Path, label: str) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    if label.startswith("CPU ResNet-50"):
        from autopar.dataset.synth import write_synthetic_cifar10

        return write_synthetic_cifar10(where / "cifar", records_per_file=32)
    from autopar.dataset.mnist import write_synthetic_mnist

    return write_synthetic_mnist(where / "MNIST_Data" / "train", train=96, test=32)


def driver(work: Path, script: Path) -> Path:
    """A script whose work is in test_* functions: a driver that calls them (MindSpore runs them with pytest)."""
    tests = re.findall(r"^def (test_\w+)\(", script.read_text(), re.M)
    if not tests:
        return script
    run = work / f"_run_{script.stem}.py"
    run.write_text(f"import {script.stem}\n" + "".join(f"{script.stem}.{t}()\n" for t in tests))
    return run


def last(pattern: str, text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if re.search(pattern, ln)]
    return lines[-1][:200] if lines else ""


def run_sample(root: Path, label: str, files: list[str], timeout: float, gpu: bool = False) -> dict:
    work = Path(tempfile.mkdtemp(prefix="ms_sample_"))
    try:
        for rel in files:
            src = root / "sample_code" / rel
            if not src.is_file():
                return {"sample": label, "result": "absent", "detail": f"{rel} not found under {root}"}
            (work / src.name).write_text(rewrite(src.read_text(), gpu))
        data = make_data(work, label)
        n = NPROC.get(label, 2)
        env = {**os.environ, "DATA_PATH": str(data), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(work), str(Path(__file__).resolve().parents[1] / "src"),
                                              os.environ.get("PYTHONPATH", "")])}
        result = {"sample": label, "files": files, "ranks": n, "steps": []}
        entries = ENTRY.get(label, [Path(files[0]).name])
        if gpu:  # a dry run writes no checkpoint: the inference half has nothing to load
            entries = entries[:1]
        start = time.time()
        for entry in entries:
            script = driver(work, work / entry)
            logs = work / f"logs_{Path(entry).stem}"
            cmd = [sys.executable, "-m", "autopar.cli.main", "launch", "-n", str(n), "--log-dir", str(logs)]
            if gpu:  # rank 0 (and each pipeline stage's first rank) on simulated GPUs, through two steps
                cmd[4:4] = ["--dry-run", "--dry-run-device", "cuda"]
            elif label in RANK_TABLE:
                cmd = [sys.executable, "-m", "autopar.cli.main", "launch", "--rank-table",
                       str(rank_table(work / "rank_table_8pcs.json", n)), "--server-id", "127.0.0.1",
                       "--log-dir", str(logs)]
            cwd = work
            if label in DEVICE_FOLDERS:
                cwd = work / "device0"
                cwd.mkdir(exist_ok=True)
                for i in range(1, n):
                    if not (work / f"device{i}").exists():
                        (work / f"device{i}").symlink_to(cwd, target_is_directory=True)
            try:
                proc = subprocess.run(cmd + [str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                                      timeout=timeout, start_new_session=True)
                rc, out = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as exc:
                rc, out = "timeout", (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
                    else (exc.stdout or "")
            log0 = logs / ("dryrun_rank0.log" if gpu else "worker_0.log")
            text = out + (log0.read_text(errors="replace") if log0.is_file() else "")
            result["steps"].append({"script": entry, "rc": rc,
                                    "loss": last(r"loss is|loss:", text),
                                    "error": "" if rc == 0 else last(r"Error|error:|Exception|Traceback|failed", text)})
            if rc != 0:
                break
        result["seconds"] = round(time.time() - start, 1)
        result["result"] = "ran" if all(s["rc"] == 0 for s in result["steps"]) and \
            len(result["steps"]) == len(entries) else "failed"
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def markdown(results: list[dict]) -> str:
    out = ["| sample | ranks | result | seconds | last loss line / error line |", "|---|---|---|---|---|"]
    for r in results:
        parts = [(s["loss"] or f"{s['script']} ran") if s["rc"] == 0 else f"{s['script']}: {s['error']}"
                 for s in r.get("steps", [])]
        detail = "; ".join(parts) or r.get("detail", "")
        out.append(f"| {r['sample']} | {r.get('ranks', '')} | {r['result']} | {r.get('seconds', '')} | "
                   f"{detail.replace('|', '/')} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", help="the directory tools/ms_names.py --extract wrote")
    ap.add_argument("--only", action="append", help="run only this sample (its label); repeatable")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--gpu", action="store_true",
                    help="keep each sample's GPU (Ascend: GPU, HCCL: NCCL) and dry-run it on simulated GPUs "
                         "(autopar launch --dry-run --dry-run-device cuda): its GPU path, two steps, rank 0")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    results = []
    for label, files in CORE.items():
        if args.only and label not in args.only:
            continue
        res = run_sample(Path(args.root), label, files, args.timeout, args.gpu)
        print(json.dumps(res), flush=True)
        results.append(res)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
