"""Helpers for tests with real processes on 127.0.0.1, each test cleaning up its own.

Every process a test starts carries a unique ``AUTOPAR_TEST_TAG`` in its environment. ``procs.leftovers()`` finds
any process still alive with that tag (also grandchildren the test never saw), so a test can assert that the code
under test left nothing behind; at teardown every tagged process is killed regardless.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
PYTHON = sys.executable

# Variables of the launch contracts: a test's child must see only what the test sets.
CONTRACT_VARS = (
    "MS_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_NODE_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK",
    "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK_TABLE_FILE", "MINDSPORE_HCCL_CONFIG_PATH", "RANK_ID",
    "RANK_SIZE", "DEVICE_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "AUTOPAR_RANK", "AUTOPAR_JOB_TOKEN", "SLURM_PROCID", "SLURM_NTASKS",
    "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_TASKS_PER_NODE",
    "SLURM_STEP_TASKS_PER_NODE", "SLURM_JOB_ID", "SLURM_STEP_ID", "JOB_COMPLETION_INDEX", "GLOO_SOCKET_IFNAME",
)


def worker_logs(log_dir: Path, lines: int = 60) -> str:
    """The end of every worker's log in ``log_dir``: what a failed launch's assertion shows (a rank that crashed
    in native code has its threads' Python stacks there)."""
    out = []
    for log in sorted(Path(log_dir).glob("worker_*.log")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"----- {log.name} -----\n" + "\n".join(text))
    return "\n".join(out)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Procs:
    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex
        self.popens: list[subprocess.Popen] = []

    def env(self, **extra: str) -> dict[str, str]:
        return clean_env(AUTOPAR_TEST_TAG=self.tag, **extra)

    def start(self, cmd: list[str], env: dict[str, str] | None = None, log: Path | None = None,
              **kwargs) -> subprocess.Popen:
        env = dict(env or self.env())
        env["AUTOPAR_TEST_TAG"] = self.tag
        out = open(log, "wb") if log else subprocess.PIPE
        popen = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if log else subprocess.PIPE,
                                 start_new_session=True, cwd=kwargs.pop("cwd", ROOT), **kwargs)
        if log:
            out.close()
        self.popens.append(popen)
        return popen

    def run(self, cmd: list[str], env: dict[str, str] | None = None, timeout: float = 120, **kwargs):
        """Run to completion; returns CompletedProcess with text stdout/stderr. Kills the group on timeout."""
        popen = self.start(cmd, env, **kwargs)
        try:
            out, err = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            out, err = popen.communicate()
            raise AssertionError(f"timed out after {timeout}s: {cmd}\nstdout:\n{out.decode()}\nstderr:\n{err.decode()}") from None
        return subprocess.CompletedProcess(cmd, popen.returncode, out.decode(errors="replace"),
                                           err.decode(errors="replace"))

    def leftovers(self) -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["pid"]):
            if proc.pid == os.getpid():
                continue
            try:
                if proc.environ().get("AUTOPAR_TEST_TAG") == self.tag and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def wait_no_leftovers(self, timeout: float = 10.0) -> list[psutil.Process]:
        deadline = time.monotonic() + timeout
        while True:
            left = self.leftovers()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def kill_all(self) -> None:
        for p in self.popens:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in self.leftovers():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        for p in self.popens:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass



def autopar_cmd(*args: str) -> list[str]:
    return [PYTHON, "-m", "autopar.cli.main", *args]


def wait_for(path: Path, text: str, timeout: float = 90) -> None:
    """Until ``text`` appears in the file at ``path`` (a worker's log saying it got somewhere)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared in {path}")


def find_worker(procs: "Procs", rank: int, role: str = "MS_WORKER", timeout: float = 90) -> psutil.Process:
    """The live process of ``rank`` in a job ``procs`` started (found by its MindSpore role and autopar rank)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs.leftovers():
            try:
                env = proc.environ()
            except psutil.Error:
                continue
            if env.get("MS_ROLE") == role and env.get("AUTOPAR_RANK") == str(rank):
                return proc
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} not found")

