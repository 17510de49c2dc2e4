"""The sweep's shared pieces: outcomes, a case's Run and Verdict, the case registry, the per-case process context
and the classifier.

They live here, not in ``sweep.py``, so that the case modules (``sweep_cases/*``) and the runner (``sweep.py``) both
import them and neither imports the other: ``sweep.py`` -> ``sweep_cases`` -> ``sweep_core``, one way."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
OUTCOMES = ("clear error", "warned", "held", "vague", "traceback", "hang", "accepted", "lost", "left behind")
TRACE_MARKS = ("Traceback (most recent call last)", "frame #", "terminate called", "Exception raised from")
CONTRACT_VARS = ("MS_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK_TABLE_FILE", "RANK_ID", "RANK_SIZE",
                 "DEVICE_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "AUTOPAR_RANK", "AUTOPAR_JOB_TOKEN",
                 "SLURM_PROCID", "SLURM_NTASKS", "JOB_COMPLETION_INDEX", "AUTOPAR_LOG_DIR")


@dataclass
class Run:
    rc: int | None
    out: str
    err: str
    secs: float
    timed_out: bool
    logs: str = ""  # the job's log files (a launched job), searched for tracebacks too

    @property
    def text(self) -> str:
        return self.out + self.err + self.logs


@dataclass
class Case:
    category: str
    name: str
    expect: str  # "error": a bad input or a fault that must end in one clear line; "ok": must work / hold
    fn: Callable
    new: bool = False  # exercises a feature older trees lack (skipped with --src)


@dataclass
class Verdict:
    """What a case function may return besides its Run: an outcome decided by its own check, and a note."""

    run: Run
    outcome: str | None = None
    note: str = ""


CASES: list[Case] = []


def case(category: str, name: str, expect: str = "error", new: bool = False):
    def deco(fn):
        CASES.append(Case(category, name, expect, fn, new))
        return fn
    return deco


class Ctx:
    """Runs one case's processes: clean environment, its own directory, a tag to find what it left behind."""

    def __init__(self, src: Path, workdir: Path):
        self.src = src
        self.dir = workdir
        self.tag = uuid.uuid4().hex
        self.repo = ROOT
        self._n = 0

    def env(self, **extra) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
        env.update(PYTHONPATH=f"{self.src}{os.pathsep}{self.dir}", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   AUTOPAR_SWEEP_TAG=self.tag, AUTOPAR_CLUSTER_TIMEOUT="60", AUTOPAR_HEARTBEAT_TIMEOUT="5")
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def path(self, name: str) -> Path:
        return self.dir / name

    def script(self, code: str, name: str | None = None) -> Path:
        self._n += 1
        path = self.dir / (name or f"case_{self._n}.py")
        path.write_text(textwrap.dedent(code))
        return path

    def start(self, cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> subprocess.Popen:
        return subprocess.Popen(cmd, env=env or self.env(), cwd=cwd or self.dir, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)

    def finish(self, popen: subprocess.Popen, limit: float, t0: float, logs: Path | None = None) -> Run:
        timed_out = False
        try:
            out, err = popen.communicate(timeout=max(0.1, limit - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(popen.pid)
            out, err = popen.communicate()
        secs = time.monotonic() - t0
        text = ""
        if logs is not None and logs.is_dir():
            text = "".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.log"))
                           if not p.name.startswith("env_"))
        return Run(popen.returncode, out.decode(errors="replace"), err.decode(errors="replace"), secs, timed_out,
                   text)

    def run(self, cmd: list[str], limit: float = 60, env: dict | None = None, logs: Path | None = None) -> Run:
        t0 = time.monotonic()
        return self.finish(self.start(cmd, env), limit, t0, logs)

    def python(self, code: str, limit: float = 60, **env) -> Run:
        return self.run([PYTHON, str(self.script(code))], limit, self.env(**env))

    def cli(self, *args: str, limit: float = 60, **env) -> Run:
        return self.run([PYTHON, "-m", "autopar.cli.main", *args], limit, self.env(**env))

    def launch_cmd(self, n: int, script: Path | str, *flags: str, logs: Path) -> list[str]:
        return [PYTHON, "-m", "autopar.cli.main", "launch", "-n", str(n), "--log-dir", str(logs), *flags, str(script)]

    def launch(self, n: int, script: Path | str, *flags: str, args: tuple = (), limit: float = 90, **env) -> Run:
        logs = self.dir / f"logs_{self._n}_{uuid.uuid4().hex[:6]}"
        return self.run(self.launch_cmd(n, script, *flags, logs=logs) + list(args), limit, self.env(**env), logs)

    def free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def leftovers(self) -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["pid"]):
            try:
                if proc.environ().get("AUTOPAR_SWEEP_TAG") == self.tag and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def wait_gone(self, timeout: float = 8.0) -> list[psutil.Process]:
        deadline = time.monotonic() + timeout
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def find_worker(self, rank: int, timeout: float = 60.0) -> psutil.Process | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.leftovers():
                try:
                    env = proc.environ()
                except psutil.Error:
                    continue
                if env.get("AUTOPAR_RANK") == str(rank) and env.get("MS_ROLE") == "MS_WORKER":
                    return proc
            time.sleep(0.2)
        return None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def error_line(text: str) -> bool:
    return any(line.startswith(("autopar: error:", "msrun: error:")) or ": error: " in line
               for line in text.splitlines())


def classify(c: Case, v: Verdict, left: list) -> str:
    run = v.run
    if run.timed_out:
        return "hang"
    if left:
        return "left behind"
    if v.outcome is not None:
        return v.outcome
    if any(mark in run.text for mark in TRACE_MARKS) or run.rc in (-6, 134):
        return "traceback"
    if c.expect == "error":
        if run.rc == 0:
            return "warned" if "warning" in run.text.lower() else "accepted"
        return "clear error" if error_line(run.err + run.out) else "traceback"
    return "held" if run.rc == 0 else ("clear error" if error_line(run.err + run.out) else "traceback")


def run_case(c: Case, src: Path, keep: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="autopar-sweep-") as tmp:
        ctx = Ctx(src, Path(tmp))
        t0 = time.monotonic()
        try:
            got = c.fn(ctx)
            v = got if isinstance(got, Verdict) else Verdict(got)
        except Exception as exc:  # noqa: BLE001 - a broken case is reported, the sweep goes on
            v = Verdict(Run(None, "", f"sweep case error: {exc!r}", time.monotonic() - t0, False), "traceback",
                        f"case raised {exc!r}")
        left = ctx.wait_gone()
        for proc in left:
            try:
                proc.kill()
            except psutil.Error:
                pass
        outcome = classify(c, v, left)
        tail = (v.run.err + v.run.out).strip().splitlines()[-6:]
        return {"category": c.category, "name": c.name, "expect": c.expect, "outcome": outcome,
                "seconds": round(v.run.secs, 1), "rc": v.run.rc, "note": v.note,
                "left_behind": [p.pid for p in left], "tail": [line[:300] for line in tail]}
