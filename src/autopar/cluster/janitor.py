"""The job's janitor: a tiny process that outlives the launcher and kills whatever the job left behind.

Why: every child of the launcher dies with it (``PR_SET_PDEATHSIG``), but the processes a user's script starts -- a
metrics uploader, a ``sleep``, a helper started with ``start_new_session`` -- are only reparented to init when their
parent dies, and live on. The janitor is started with the launcher, in a session of its own (a signal to the
launcher's terminal or process group does not reach it), and reads a pipe from the launcher: the pid of every
process it spawns (each the leader of its own session), then end of file when the launcher exits -- however it
exits, ``kill -9`` included. It then kills every process of those sessions and every process whose environment
carries this launch's ``AUTOPAR_LAUNCH_ID`` (which also finds the ones that left the session), and exits.

This file runs as a script (``python -I janitor.py LAUNCH_ID``) and imports only the standard library: it costs a
few milliseconds and a few megabytes, not an ``import torch``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

MARK = "AUTOPAR_LAUNCH_ID"


def _session(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def _carries(pid: int, mark: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return mark in fh.read().split(b"\0")
    except OSError:
        return False


def job_processes(sessions: set[int], launch_id: str, me: int) -> list[int]:
    """Every process of these sessions or carrying this launch's id, except ``me``."""
    mark = f"{MARK}={launch_id}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        if _session(pid) in sessions or _carries(pid, mark):
            found.append(pid)
    return found


def sweep(sessions: set[int], launch_id: str) -> int:
    """SIGKILL the job's processes, a few rounds (one may fork while we look); returns how many were killed."""
    me, killed = os.getpid(), 0
    for _ in range(5):
        victims = job_processes(sessions, launch_id, me)
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
    return killed


def serve(launch_id: str, fd: int = 0) -> None:
    """Read session leaders' pids from ``fd`` until end of file, then sweep."""
    sessions: set[int] = set()
    pending = b""
    while True:
        try:
            data = os.read(fd, 4096)
        except InterruptedError:
            continue
        if not data:
            break
        pending += data
        *lines, pending = pending.split(b"\n")
        sessions.update(int(x) for x in lines if x.strip().isdigit())
    sweep(sessions, launch_id)


class Janitor:
    """The launcher's end of the pipe."""

    def __init__(self, launch_id: str):
        read, self.fd = os.pipe()
        os.set_inheritable(self.fd, False)
        try:
            self.popen = subprocess.Popen([sys.executable, "-I", __file__, launch_id], stdin=read,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True, close_fds=True)
        finally:
            os.close(read)

    def track(self, pid: int) -> None:
        """``pid`` leads a session of the job: its members go when the launcher goes."""
        try:
            os.write(self.fd, f"{pid}\n".encode())
        except OSError:
            pass

    def close(self, wait: float = 5.0) -> None:
        """The launcher is done: the janitor sweeps what is left and exits."""
        if self.fd < 0:
            return
        os.close(self.fd)
        self.fd = -1
        try:
            self.popen.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


if __name__ == "__main__":  # pragma: no cover - the janitor process itself
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    serve(sys.argv[1])
