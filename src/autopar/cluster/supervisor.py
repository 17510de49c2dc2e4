"""Running the processes of one job on this host: spawn, watch, stop, report.

Every child gets its own session (so a signal to the launcher's terminal never reaches it directly and its whole
process group can be killed) and ``PR_SET_PDEATHSIG`` (so it dies with the launcher even if the launcher is killed
with SIGKILL); what the children start themselves is the janitor's (:mod:`autopar.cluster.janitor`). The first
failure stops everything: SIGTERM (and SIGCONT, so that a stopped process can act on it), a grace period, SIGKILL.
The report names the failed rank, how it ended and the tail of its log; ranks that only stopped because another
failed (``EXIT_ABORTED``) are not mistaken for the cause, a stopped (SIGSTOP) rank is named at once, and a rank that
exits 0 without joining a job the others joined is a failure, not a success.
"""
from __future__ import annotations

import codecs
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from autopar.cluster.boot import BOOT_DIR
from autopar.cluster.boot.sitecustomize import END_MARK
from autopar.cluster.protocol import EXIT_ABORTED

POLL = 0.1


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


def exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def tail(path: Path, lines: int = 20) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            return fh.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def crash_report(path: Path, before: int = 20, lines: int = 40) -> list[str]:
    """A rank that crashed in native code, from its log: what it printed last, then where it crashed.

    Python's fault handler (the launcher turns it on) dumps every thread's stack at the crash; the thread that
    crashed comes last, after other threads' stacks that :func:`tail`'s lines would show instead. Empty when the
    log holds no such dump."""
    text = tail(path, 2000)
    fatal = [i for i, line in enumerate(text) if line.startswith("Fatal Python error:")]
    if not fatal:
        return []
    at = fatal[-1]
    current = [i for i in range(at + 1, len(text)) if text[i].startswith("Current thread ")]
    start = current[-1] if current else at + 1
    block = [line for line in text[start:] if line.strip() and not line.startswith("Extension modules:")]
    printed = [line for line in text[:at] if line.strip()][-before:]
    return printed + [text[at]] + block[:lines]


ERROR_MARK = "autopar: error: "  # how a rank's one-line error begins (cli.main.guarded, cluster.worker)


class Streamer(threading.Thread):
    """Copies the ranks' growing logs to the console, a line at a time: each line prefixed ``[rank N]`` where
    several ranks are shown (torchrun shows every rank's output too), the bare lines where one is.

    A rank's one-line error (``autopar: error: ...``) is held back: the launcher's report prints it once, with every
    rank that hit the same one, where streaming would repeat it once per rank."""

    def __init__(self, logs: dict[int, Path]):
        super().__init__(name="autopar-stream", daemon=True)
        self.logs = logs
        self.prefixed = len(self.logs) > 1
        self.stop_event = threading.Event()
        self.pos = dict.fromkeys(self.logs, 0)
        self.partial = dict.fromkeys(self.logs, "")
        # a character whose bytes a read splits is decoded whole with the next read, not as two replacement marks
        self.decoders = {rank: codecs.getincrementaldecoder("utf-8")(errors="replace") for rank in self.logs}

    def _show(self, rank: int, line: str) -> None:
        if not line.startswith(ERROR_MARK):
            sys.stdout.write(f"[rank {rank}] {line}" if self.prefixed else line)

    def pump(self, final: bool = False) -> None:
        wrote = False
        for rank, path in self.logs.items():
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.pos[rank])
                    data = fh.read()
            except OSError:
                continue
            self.pos[rank] += len(data)
            text = self.partial[rank] + self.decoders[rank].decode(data, final=final)
            lines = text.splitlines(keepends=True)
            self.partial[rank] = lines.pop() if lines and not lines[-1].endswith(("\n", "\r")) else ""
            if final and self.partial[rank]:
                lines.append(self.partial[rank] + "\n")
                self.partial[rank] = ""
            for line in lines:
                self._show(rank, line)
            wrote = wrote or bool(lines)
        if wrote:
            sys.stdout.flush()

    def run(self) -> None:
        while not self.stop_event.wait(0.2):
            self.pump()

    def finish(self) -> None:
        self.stop_event.set()
        self.join(timeout=2)
        self.pump(final=True)


class ForkedChild:
    """The part of ``subprocess.Popen`` the supervisor uses, for a child forked from the launcher itself."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


@dataclass
class Proc:
    name: str
    rank: int | None  # None for the scheduler
    popen: subprocess.Popen | ForkedChild
    log: Path
    detail: str | None = None  # how it failed, when its exit status does not say it


def _stopped(pid: int) -> bool:
    """Is the process stopped (SIGSTOP / SIGTSTP), so that it neither works nor exits?"""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class JobProbe:
    """What the scheduler knows, for the launcher: has rank r joined the job, has anyone? (None: cannot tell.)"""

    def admitted(self, rank: int) -> bool | None:  # pragma: no cover - interface
        return None

    def anyone(self) -> bool | None:  # pragma: no cover - interface
        return None


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    """The processes of one attempt of the job on this host."""

    def __init__(self, command: list[str], log_dir: Path, grace: float = 10.0, janitor=None,
                 probe: JobProbe | None = None):
        self.command = command
        self.log_dir = log_dir
        self.grace = grace
        self.janitor = janitor  # told every child's pid (each leads its session)
        self.probe = probe or JobProbe()
        self._admitted: set[int] = set()  # ranks the probe saw admitted (asked once each)
        self.procs: list[Proc] = []
        self.failed: list[Proc] = []
        self.interrupted: int | None = None

    def _track(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        if self.janitor is not None:
            self.janitor.track(proc.popen.pid)
        return proc

    def spawn(self, name: str, rank: int | None, env: dict[str, str]) -> Proc:
        log = self.log_dir / f"{name}.log"
        if rank is not None:  # where the rank leaves its verdict, "ok"/"failed" (boot/sitecustomize.py)
            for stale in self.log_dir.glob(f".{name}.ended.*"):
                stale.unlink(missing_ok=True)
            path = os.pathsep.join(p for p in (BOOT_DIR, env.get("PYTHONPATH")) if p)
            env = dict(env, **{END_MARK: str(self.log_dir / f".{name}.ended"), "PYTHONPATH": path})
        with open(log, "wb") as fh:
            popen = subprocess.Popen(self.command, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        return self._track(Proc(name, rank, popen, log))

    def fork(self, name: str, rank: int | None, target: Callable[[], int]) -> Proc:
        """Run ``target`` in a child forked from this process (already past its imports, so it is ready at once)
        with the same session, parent-death and log rules as :meth:`spawn`; the child exits with target's code."""
        log = self.log_dir / f"{name}.log"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child; coverage does not follow forks
            code = 1
            try:
                os.setsid()
                _die_with_parent()
                if self.janitor is not None:
                    os.close(self.janitor.fd)  # only the launcher may hold the janitor's pipe open
                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_DFL)
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
                code = target()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException as exc:  # noqa: BLE001 - reported in the log, never returns into the launcher
                print(f"autopar: error: {name}: {exc}", file=sys.stderr)
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        return self._track(Proc(name, rank, ForkedChild(pid), log))

    def stop_all(self) -> None:
        """SIGTERM every live process group, then SIGKILL whatever is left after the grace period."""
        live = [p for p in self.procs if p.popen.poll() is None]
        for p in live:
            _signal_group(p.popen.pid, signal.SIGTERM)
            _signal_group(p.popen.pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(p.popen.poll() is None for p in live):
            time.sleep(POLL)
        for p in self.procs:
            _signal_group(p.popen.pid, signal.SIGKILL)  # also reaps grandchildren left in the session
            if p.popen.poll() is None:
                p.popen.wait()

    def watch(self) -> int:
        """Until every worker ended (0) or one failed (its exit status); the scheduler's failure counts too."""
        workers = [p for p in self.procs if p.rank is not None]
        scheduler = next((p for p in self.procs if p.rank is None), None)
        first_abort: float | None = None
        seen: dict[int, float] = {}  # rank -> when its failure was first seen
        unjoined: list[Proc] = []  # exited 0 without ever joining the job
        next_probe = 0.0
        while True:
            if self.interrupted is not None:
                print(f"[autopar] {signal.Signals(self.interrupted).name} received: stopping the job", file=sys.stderr)
                return 130 if self.interrupted == signal.SIGINT else 143
            codes = {p.rank: self._exit_code(p) for p in workers}
            failed = [p for p in workers if codes[p.rank] not in (None, 0)]
            now = time.monotonic()
            for p in failed:
                seen.setdefault(p.rank, now)
            if failed:
                # first seen first; among those seen together, a signal (a kill) before an exit code (its echo)
                root = sorted((p for p in failed if codes[p.rank] != EXIT_ABORTED),
                              key=lambda p: (seen[p.rank], codes[p.rank] >= 0))
                stopped = [p for p in workers if codes[p.rank] is None and _stopped(p.popen.pid)]
                for p in stopped:
                    p.detail = "stopped (SIGSTOP): it neither worked nor exited"
                if not root and first_abort is None:
                    first_abort = now
                # a rank that stopped only because another failed: give the cause a moment to show its exit code
                if root or stopped or now - first_abort > 5.0:
                    self.failed = root or stopped or failed + ([scheduler] if scheduler else [])
                    if root:
                        return exit_status(codes[root[0].rank])
                    return 128 + signal.SIGSTOP if stopped else exit_status(codes[failed[0].rank])
            if scheduler is not None and now >= next_probe and any(c == 0 for c in codes.values()):
                next_probe = now + 0.5
                code = self._unjoined_exit(workers, codes, unjoined)
                if code is not None:
                    return code
            if all(c == 0 for c in codes.values()):
                nobody = scheduler is not None and scheduler.popen.poll() is None and not self._admitted \
                    and self.probe.anyone() is False  # no worker ever asked to join: nothing to wait for
                if scheduler is not None and not nobody:
                    try:
                        scheduler.popen.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        pass
                    if scheduler.popen.returncode not in (0, None):
                        self.failed = [scheduler]
                        return exit_status(scheduler.popen.returncode)
                return 0
            if scheduler is not None and scheduler.popen.poll() not in (None, 0):
                # the scheduler gives up when a worker failed: name that worker if it ends within the grace (a
                # scheduler killed by a signal gave up on nobody: the job ends at once)
                deadline = time.monotonic() + (1.0 if scheduler.popen.poll() < 0 else 5.0)
                while time.monotonic() < deadline and any(p.popen.poll() is None for p in workers):
                    time.sleep(POLL)
                codes = {p.rank: self._exit_code(p) for p in workers}
                root = [p for p in workers if codes[p.rank] not in (None, 0, EXIT_ABORTED)]
                self.failed = root or [scheduler]
                return exit_status(codes[root[0].rank]) if root else exit_status(scheduler.popen.returncode or 1)
            time.sleep(POLL)

    def _exit_code(self, p: Proc) -> int | None:
        """The worker's exit status, where an abort in the interpreter's teardown after the script had ended cleanly
        (its end mark written) counts as the clean end it was -- said once, as a warning."""
        code = p.popen.poll()
        if code != -signal.SIGABRT:
            return code
        try:
            ended = (self.log_dir / f".{p.name}.ended.{p.popen.pid}").read_text().strip() == "ok"
        except OSError:
            ended = False
        if not ended:
            return code
        if not getattr(p, "teardown_warned", False):
            p.teardown_warned = True
            print(f"[autopar] warning: rank {p.rank} aborted (SIGABRT) while its process tore down, after its "
                  f"script had ended cleanly: counted as a clean end (torch's C++ threads at interpreter exit)",
                  file=sys.stderr, flush=True)
        return 0

    def _unjoined_exit(self, workers: list[Proc], codes: dict, unjoined: list[Proc]) -> int | None:
        """A worker that exited 0 without joining the job while others joined: the others would wait for it until
        the cluster timeout. Returns the exit status that ends the job then, else None (no one joined: a script
        that never calls ``init()``, or a torchrun-style one that forms torch's world by itself)."""
        for p in workers:
            if codes[p.rank] != 0 or p in unjoined or p.rank in self._admitted:
                continue
            admitted = self.probe.admitted(p.rank)
            if admitted:
                self._admitted.add(p.rank)
            elif admitted is False:
                unjoined.append(p)
        if unjoined and self.probe.anyone():
            for p in unjoined:
                p.detail = ("exited with code 0 before joining the job (it never called init()), while the other "
                            "ranks wait for it")
            self.failed = list(unjoined)
            return 1
        return None

    def report(self) -> None:
        """Each failed process once: how it ended and the end of its log. Ranks that failed with the same one-line
        error (a configuration every rank reads alike) are one entry naming them all."""
        shown: set[int] = set()
        for p in self.failed:
            if id(p) in shown:
                continue
            who = f"rank {p.rank}" if p.rank is not None else "the scheduler"
            how = p.detail or describe_exit(p.popen.returncode)
            if p.rank is None and p.popen.returncode is not None and p.popen.returncode < 0:
                # killed from outside: its log only says how the job began; the workers were stopped with it
                print(f"autopar: error: the scheduler (pid {p.popen.pid}) was {how}: the job lost its "
                      f"rendezvous and every worker was stopped", file=sys.stderr)
                continue
            crash = crash_report(p.log)
            lines = crash or tail(p.log)
            error = None if crash or p.detail else one_line_error(lines)
            if error is None:
                print(f"autopar: error: {who} failed: {how}", file=sys.stderr)
            else:
                # every rank whose log ends with it (one that raced to it second may count as stopped by the first)
                workers = [q for q in self.procs if q.rank is not None]
                alike = [q for q in workers if q is p or one_line_error(tail(q.log)) == error]
                shown.update(id(q) for q in alike)
                ranks = sorted(q.rank for q in alike)
                if len(ranks) > 1:
                    who = f"every rank ({_ranks(ranks)})" if len(ranks) == len(workers) else f"ranks {_ranks(ranks)}"
                print(f"{ERROR_MARK}{who} failed: {error}", file=sys.stderr)
                lines = [line for line in lines if not _is_error_line(line)]
            if lines:
                print(f"----- the end of {p.log}, and where it crashed -----" if crash else
                      f"----- last {len(lines)} lines of {p.log} -----", file=sys.stderr)
                for line in lines:
                    print(f"  {line}", file=sys.stderr)
        sys.stderr.flush()


_RANK_TAG = re.compile(r"^\[rank \d+\] ")


def _is_error_line(line: str) -> bool:
    return line.startswith(ERROR_MARK)


def one_line_error(lines: list[str]) -> str | None:
    """The one-line error a rank ended with (``autopar: error: [rank N] ...``), less its mark and rank tag: the same
    text for every rank that hit the same error. None where the log does not end with one."""
    for line in reversed(lines):
        if not line.strip():
            continue
        return _RANK_TAG.sub("", line[len(ERROR_MARK):]) if _is_error_line(line) else None
    return None


def _ranks(ranks: list[int]) -> str:
    """``0..3`` for consecutive ranks, else ``0, 2, 5``."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}..{ranks[-1]}"
    return ", ".join(map(str, ranks))
