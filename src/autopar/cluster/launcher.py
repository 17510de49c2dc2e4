"""``autopar launch``: start the scheduler and N workers of the MindSpore contract on this host and supervise them.

The launcher uses exactly the environment a hand-written ``run.sh`` would (``MS_ROLE``, ``MS_WORKER_NUM``,
``MS_SCHED_HOST``, ``MS_SCHED_PORT``), so the two are interchangeable. What it adds: a race-free port (the
listening socket is handed to the scheduler), a random job token, per-rank log files, rank 0 streamed to the
console, a failure report naming the rank, how it ended and the tail of its log, and the guarantee that no process
outlives the job (every child is in its own session and dies with the launcher via PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import ctypes
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from autopar.cluster.netutil import bind_listener
from autopar.cluster.protocol import EXIT_ABORTED
from autopar.errors import ClusterError

POLL = 0.1


@dataclass
class LaunchConfig:
    nproc: int
    script: str
    script_args: list[str] = field(default_factory=list)
    log_dir: str = "autopar_logs"
    port: int | None = None
    host: str = "127.0.0.1"
    python: str = sys.executable
    stream_rank: int | None = 0
    grace: float = 10.0  # seconds between SIGTERM and SIGKILL when stopping the job
    extra_env: dict[str, str] = field(default_factory=dict)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == EXIT_ABORTED:
        return "stopped because another rank failed"
    return f"exited with code {code}"


def tail(path: Path, lines: int = 20) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            return fh.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


class _Streamer(threading.Thread):
    """Copies a growing log file to the console (rank 0's output)."""

    def __init__(self, path: Path):
        super().__init__(name="autopar-stream", daemon=True)
        self.path = path
        self.stop_event = threading.Event()
        self.pos = 0

    def pump(self) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.pos)
                data = fh.read()
        except OSError:
            return
        if data:
            self.pos += len(data)
            sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()

    def run(self) -> None:
        while not self.stop_event.wait(0.2):
            self.pump()

    def finish(self) -> None:
        self.stop_event.set()
        self.join(timeout=2)
        self.pump()


@dataclass
class _Proc:
    name: str
    rank: int | None
    popen: subprocess.Popen
    log: Path


class Launcher:
    def __init__(self, cfg: LaunchConfig):
        if cfg.nproc < 1:
            raise ClusterError(f"-n must be a positive number of workers, got {cfg.nproc}")
        if not Path(cfg.script).is_file():
            raise ClusterError(f"script not found: {cfg.script}")
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir).resolve()
        self.procs: list[_Proc] = []
        self._interrupted: int | None = None

    # -- process control -----------------------------------------------------------------------------------------
    def _env(self, port: int, token: str) -> dict[str, str]:
        env = dict(os.environ)
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RANK_TABLE_FILE", "MINDSPORE_HCCL_CONFIG_PATH"):
            env.pop(var, None)  # the MindSpore contract takes over; stale variables would only confuse
        env.update(
            MS_WORKER_NUM=str(self.cfg.nproc),
            MS_SCHED_HOST=self.cfg.host,
            MS_SCHED_PORT=str(port),
            AUTOPAR_JOB_TOKEN=token,
            AUTOPAR_LOG_DIR=str(self.log_dir),
            PYTHONUNBUFFERED="1",
        )
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores between local workers unless the user chose
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.cfg.nproc))
        env.update(self.cfg.extra_env)
        return env

    def _spawn(self, name: str, rank: int | None, env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> _Proc:
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as fh:
            popen = subprocess.Popen(
                [self.cfg.python, self.cfg.script, *self.cfg.script_args],
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=pass_fds,
                preexec_fn=_die_with_parent,
            )
        proc = _Proc(name, rank, popen, log)
        self.procs.append(proc)
        return proc

    def _stop_all(self) -> None:
        """SIGTERM every live process group, then SIGKILL whatever is left after the grace period."""
        live = [p for p in self.procs if p.popen.poll() is None]
        for p in live:
            _signal_group(p.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.grace
        while time.monotonic() < deadline and any(p.popen.poll() is None for p in live):
            time.sleep(POLL)
        for p in self.procs:
            _signal_group(p.popen.pid, signal.SIGKILL)  # also reaps grandchildren left in the session
            if p.popen.poll() is None:
                p.popen.wait()

    def _on_signal(self, signum, frame) -> None:
        self._interrupted = signum

    # -- the job -------------------------------------------------------------------------------------------------
    def run(self) -> int:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        listener = bind_listener(self.cfg.host, self.cfg.port or 0)
        port = listener.getsockname()[1]
        token = secrets.token_hex(16)
        env = self._env(port, token)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        streamer = None
        try:
            fd = listener.fileno()
            self._spawn("scheduler", None, {**env, "MS_ROLE": "MS_SCHED", "AUTOPAR_SCHED_LISTEN_FD": str(fd)}, (fd,))
            listener.close()
            for rank in range(self.cfg.nproc):
                wenv = {**env, "MS_ROLE": "MS_WORKER", "AUTOPAR_RANK": str(rank)}
                (self.log_dir / f"env_{rank}.log").write_text("".join(f"{k}={v}\n" for k, v in sorted(wenv.items())))
                self._spawn(f"worker_{rank}", rank, wenv)
            print(
                f"[autopar] launched {self.cfg.nproc} workers + scheduler on {self.cfg.host}:{port}; "
                f"logs in {self.log_dir}",
                flush=True,
            )
            if self.cfg.stream_rank is not None:
                streamer = _Streamer(self.log_dir / f"worker_{self.cfg.stream_rank}.log")
                streamer.start()
            code = self._supervise()
        finally:
            listener.close()
            self._stop_all()
            if streamer is not None:
                streamer.finish()
            for s, handler in old.items():
                signal.signal(s, handler)
        if code != 0:
            self._report_failure()
        return code

    def _supervise(self) -> int:
        workers = [p for p in self.procs if p.rank is not None]
        scheduler = self.procs[0]
        first_abort: float | None = None
        while True:
            if self._interrupted is not None:
                print(f"[autopar] {signal.Signals(self._interrupted).name} received: stopping the job", file=sys.stderr)
                return 130 if self._interrupted == signal.SIGINT else 143
            codes = {p.rank: p.popen.poll() for p in workers}
            failed = [p for p in workers if codes[p.rank] not in (None, 0)]
            if failed:
                root = [p for p in failed if codes[p.rank] != EXIT_ABORTED]
                if not root and first_abort is None:
                    first_abort = time.monotonic()
                # A rank stopped only because another failed: give the root cause a moment to show its exit code.
                if root or time.monotonic() - first_abort > 5.0:
                    self.failed = failed
                    return _exit_status(codes[(root or failed)[0].rank])
            if all(c == 0 for c in codes.values()):
                try:
                    scheduler.popen.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
                return 0 if scheduler.popen.returncode in (0, None) else scheduler.popen.returncode
            if scheduler.popen.poll() not in (None, 0):
                # the scheduler gives up when a worker failed: name that worker if it ends within the grace
                deadline = time.monotonic() + 5.0
                while time.monotonic() < deadline and any(p.popen.poll() is None for p in workers):
                    time.sleep(POLL)
                codes = {p.rank: p.popen.poll() for p in workers}
                root = [p for p in workers if codes[p.rank] not in (None, 0, EXIT_ABORTED)]
                self.failed = root or [scheduler]
                return _exit_status(codes[root[0].rank]) if root else (scheduler.popen.returncode or 1)
            time.sleep(POLL)

    def _report_failure(self) -> None:
        failed = getattr(self, "failed", [])
        if not failed:
            return
        root = [p for p in failed if p.popen.returncode != EXIT_ABORTED] or failed
        for p in root:
            who = f"rank {p.rank}" if p.rank is not None else "the scheduler"
            print(f"autopar: error: {who} failed: {describe_exit(p.popen.returncode)}", file=sys.stderr)
            lines = tail(p.log)
            if lines:
                print(f"----- last {len(lines)} lines of {p.log} -----", file=sys.stderr)
                for line in lines:
                    print(f"  {line}", file=sys.stderr)
        sys.stderr.flush()


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def launch(cfg: LaunchConfig) -> int:
    return Launcher(cfg).run()
