"""``autopar launch --dry-run -n N script.py [args]``: which ranks to simulate, each in a process of its own (the
fake world and its patches are per process), the report and ``LOG_DIR/dryrun.json``.

By default rank 0 first; then, if it met a pipeline of S stages, the first rank of every other stage (rank
``s * N / S`` runs stage s) -- one simulated rank per distinct role. ``ranks`` names others. A rank whose script
stopped on an error ends the dry run with that error as one line: the configuration error a cluster would have met.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from autopar.dryrun.tracker import PARTS
from autopar.errors import ConfigError

_TIMEOUT_S = float(os.environ.get("AUTOPAR_DRYRUN_TIMEOUT", 900))


def _human(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


def _simulate(rank: int, world: int, script: str, args: list[str], log_dir: Path, steps: int,
              device: str = "cpu") -> dict:
    out, log = log_dir / f".dryrun_rank{rank}.json", log_dir / f"dryrun_rank{rank}.log"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "autopar.dryrun.runner", "--rank", str(rank), "--world", str(world),
           "--steps", str(steps), "--device", device, "--out", str(out), script, *args]
    print(f"[autopar] dry run: rank {rank} of {world} ({steps} optimizer step{'s' if steps > 1 else ''}; its output "
          f"in {log})", flush=True)
    with open(log, "wb") as fh:
        try:
            code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            return {"rank": rank, "error": f"the simulated rank did not finish within {_TIMEOUT_S:.0f} s "
                                           "(AUTOPAR_DRYRUN_TIMEOUT)"}
    if not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {"rank": rank, "error": f"the simulated rank ended with status {code}: {tail[0]}"}
    try:
        verdict = json.loads(out.read_text())
    except ValueError as exc:
        return {"rank": rank, "error": f"the simulated rank's verdict could not be read ({exc})"}
    out.unlink()
    return verdict


def _others(first: dict, world: int, asked: list[int] | None) -> list[int]:
    if asked is not None:
        return [r for r in dict.fromkeys(asked) if r != first["rank"]]
    stages = int(first.get("pipeline_stages") or 1)
    if stages > 1 and world % stages == 0:
        return [s * (world // stages) for s in range(1, stages)]
    return []


def _table(world: int, ranks: dict[int, dict]) -> list[str]:
    head = f"{'rank':<19} {'peak':>11} {'parameters':>11} {'gradients':>11} {'optimizer':>11} {'activations':>11} " \
           f"{'other':>11}   (other: communication buffers, gathered weights, data)"
    gpu = next((v["device"] for v in ranks.values() if v.get("device")), None)
    what = f"GPU memory per rank (each rank on a simulated {gpu['name']})" if gpu else "memory per rank"
    lines = [f"[autopar] dry run of {world} ranks: {what}", head]
    for rank, v in sorted(ranks.items()):
        for label, part in ((" whole run", v), (" training step", v.get("steady") or {})):
            if not part.get("peak_bytes"):
                continue
            cells = " ".join(f"{_human(part.get(k, 0)):>11}" for k in PARTS)
            lines.append(f"{str(rank) + label:<19} {_human(part['peak_bytes']):>11} {cells}")
    lines.append("(a row 'N training step' is rank N's peak during a training step once the optimizer state exists; "
                 "'N whole run' includes setting up -- building the model, sharding it)")
    for rank, v in sorted(ranks.items()):
        step = v.get("steady") or {}
        if step.get("peak_bytes") and v["peak_bytes"] > 1.2 * step["peak_bytes"] \
                and v["parameters"] > 2 * step.get("parameters", 0):
            lines.append(f"[autopar] rank {rank}: setting up peaks {_human(v['peak_bytes'] - step['peak_bytes'])} "
                         f"above the training step: the network's parameters ({_human(v['parameters'])}) are built "
                         "whole on every rank before they are sharded (built under autopar.deferred_init(...) -- "
                         "MindSpore: nn.utils.no_init_parameters() -- each rank makes only the slices it keeps)")
        if gpu and v["peak_bytes"] > gpu["memory_bytes"]:
            lines.append(f"[autopar] rank {rank}: runs out of memory: it peaks at {_human(v['peak_bytes'])} on a GPU "
                         f"of {_human(gpu['memory_bytes'])} ({gpu['name']}; torch's allocator needs some of it too)")
    return lines


def dry_run(world: int, script: str, args: list[str], log_dir: str, ranks: list[int] | None = None,
            steps: int = 2, memory: bool = True, machine: str | None = None, local_size: int | None = None,
            device: str = "cpu") -> int:
    """Simulate ``script`` as ranks of a ``world``-rank job; 0 when every simulated rank got through its steps
    (``memory``: print each one's peak and its parts -- ``dryrun.json`` has them either way). ``device`` "cuda":
    each rank has a simulated GPU of its own (``machine``'s device, else an H100) and its memory is what is
    counted."""
    if world < 1:
        raise ConfigError(f"--dry-run needs -n >= 1, got {world}")
    if steps < 1:
        raise ConfigError(f"--dry-run-steps must be >= 1, got {steps}")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--dry-run-device takes cpu or cuda, got {device!r}")
    bad = [r for r in ranks or [] if not 0 <= r < world]
    if bad:
        raise ConfigError(f"simulated rank {bad[0]} is not in 0..{world - 1} (--dry-run-ranks, --sim_rank_id)")
    if not os.path.isfile(script):
        raise ConfigError(f"script {script!r} not found")
    if device == "cuda" and machine is None:
        machine = "h100-ib"  # the simulated GPUs' cluster: AUTO plans for the devices the script runs on
    if machine is not None:
        from autopar.planner.cluster import load_cluster

        load_cluster(machine)  # an unknown preset or a bad file: one line now, not in every simulated rank
        os.environ["AUTOPAR_DRYRUN_MACHINE"] = machine
    if local_size is not None:
        os.environ["AUTOPAR_DRYRUN_LOCAL_SIZE"] = str(local_size)
    started = time.monotonic()
    logs = Path(log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    first = _simulate(ranks[0] if ranks else 0, world, script, args, logs, steps, device)
    results = {first["rank"]: first}
    if not first.get("error"):
        for rank in _others(first, world, ranks):
            results[rank] = _simulate(rank, world, script, args, logs, steps, device)
            if results[rank].get("error"):
                break
    predicted = next((v["predicted_step_s"] for v in results.values() if v.get("predicted_step_s")), None)
    report = {"world": world, "device": device,
              "ranks": {str(r): {k: v for k, v in res.items() if k != "rank"} for r, res in sorted(results.items())},
              "predicted_step_s": predicted, "seconds": round(time.monotonic() - started, 3)}
    (logs / "dryrun.json").write_text(json.dumps(report, indent=1))
    errors = [(r, v["error"]) for r, v in sorted(results.items()) if v.get("error")]
    if errors:
        rank, line = errors[0]
        print(f"autopar: error: dry run, rank {rank} of {world}: {line} (nothing was launched; "
              f"{logs / 'dryrun.json'})", file=sys.stderr, flush=True)
        return 1
    if memory:
        for line in _table(world, results):
            print(line)
    else:
        done = min(v.get("steps", 0) for v in results.values())
        print(f"[autopar] dry run: the configuration of {world} ranks holds (ranks {', '.join(map(str, results))} "
              f"got through {done} optimizer step{'s' if done != 1 else ''})")
    for rank, v in sorted(results.items()):
        if v.get("steps", 0) < steps:
            print(f"[autopar] dry run, rank {rank}: warning: the script ended after {v.get('steps', 0)} of {steps} "
                  "optimizer steps (each optimizer's step() counts): no training-step row, and no optimizer state "
                  "unless it stepped")
        for w in v.get("warnings", []):
            print(f"[autopar] dry run, rank {rank}: warning: {w}")
    plan = next((v["plan"] for v in results.values() if v.get("plan")), None)
    if plan:
        print(f"[autopar] AUTO_PARALLEL's plan: {plan}")
    if predicted:
        print(f"[autopar] predicted step: {predicted * 1e3:.1f} ms (AUTO_PARALLEL's cost model, on "
              f"{os.environ.get('AUTOPAR_DRYRUN_MACHINE') or 'this host'})")
    print(f"[autopar] dry run done in {report['seconds']:.1f} s: {logs / 'dryrun.json'}", flush=True)
    return 0
