"""A worker's side of the MindSpore-style rendezvous: register, get a rank, keep a heartbeat, report the end.

The watchdog thread is what turns "another process died" into "this process stops with a clear message" instead
of a hang inside a collective: it exits the process when the scheduler publishes an abort or becomes unreachable.
"""
from __future__ import annotations

import atexit
import os
import select
import socket
import sys
import threading
import time

import torch.distributed as dist

from autopar.cluster import protocol as P
from autopar.cluster.boot.sitecustomize import mark_end, watch_exit_calls
from autopar.cluster.env import ClusterEnv, cluster_timeout, heartbeat_timeout
from autopar.cluster.netutil import interface_towards, port_open, port_refused
from autopar.errors import ClusterError

CLEAN_END = "it ended cleanly"  # how Watchdog.ended_ranks describes a peer that reported a clean end


def host_id(master_addr: str = "127.0.0.1") -> str:
    """Identity of this host for local-rank numbering and for naming a lost host: ``AUTOPAR_HOST_ID`` (lets one
    machine act as several), else the host name and, across hosts, the address this host reaches the scheduler
    from (host names repeat: containers, cloned images)."""
    if os.environ.get("AUTOPAR_HOST_ID"):
        return os.environ["AUTOPAR_HOST_ID"]
    found = interface_towards(master_addr)
    return f"{socket.gethostname()} ({found[1]})" if found else socket.gethostname()


def connect(cenv: ClusterEnv, timeout: float) -> dist.TCPStore:
    """Connect to the scheduler's store, waiting up to ``timeout`` for it to come up.

    Workers may legitimately start before the scheduler, so this waits; but it says once on stderr that it is
    waiting, so that a mistyped port is visible long before the timeout. It probes the port with a plain socket
    and opens the store only once something listens there: c10d's own retries would print a C++ stack dump every
    few seconds.
    """
    deadline = time.monotonic() + timeout
    announced = False
    while True:
        left = deadline - time.monotonic()
        if port_open(cenv.master_addr, cenv.master_port, timeout=max(0.2, min(left, 2.0))):
            try:
                return dist.TCPStore(cenv.master_addr, cenv.master_port, None, False,
                                     timeout=P.seconds(max(1.0, min(left, P.STORE_OP_TIMEOUT_S))))
            except Exception:
                pass
        if time.monotonic() >= deadline:
            raise ClusterError(
                f"cannot reach the scheduler at {cenv.master_addr}:{cenv.master_port} within {timeout:.0f} s "
                f"(is it started, and are MS_SCHED_HOST/MS_SCHED_PORT right?)"
            ) from None
        if not announced:
            announced = True
            print(f"autopar: waiting for the scheduler at {cenv.master_addr}:{cenv.master_port} for up to "
                  f"{timeout:.0f} s (to wait less: AUTOPAR_CLUSTER_TIMEOUT=<seconds>, or autopar launch "
                  f"--cluster-timeout / msrun --cluster_time_out)", file=sys.stderr, flush=True)
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def _optional_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ClusterError(f"{name}={raw!r} is not an integer") from None


def _wait_key(store: dist.TCPStore, key: str, deadline: float) -> bool:
    """Wait for ``key`` until ``deadline``; False on timeout. Raises ClusterError if the job was aborted.

    Polls with ``check`` rather than ``store.wait``: a timed-out wait makes c10d log a warning on every slice.
    The first polls come fast (10 ms, growing to 100 ms): joining is on the path from launch to the first step.
    """
    pause = 0.01
    while True:
        try:
            if store.check([key]):
                return True
            if store.check([P.ABORT]):
                raise ClusterError(f"the scheduler aborted the job: {store.get(P.ABORT).decode()}")
        except ClusterError:
            raise
        except Exception as exc:
            raise ClusterError(f"lost the scheduler while joining: {P.first_line(exc)}") from None
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(0.1, pause * 1.5)


def _joined(store: dist.TCPStore) -> int:
    try:
        return int(store.get(P.JOINED)) if store.check([P.JOINED]) else 0
    except Exception:
        return 0


def register(cenv: ClusterEnv) -> tuple[dist.TCPStore, int, list[str]]:
    """Join the job: returns (store, rank, host id of every rank)."""
    timeout = cluster_timeout()
    deadline = time.monotonic() + timeout
    store = connect(cenv, timeout)
    n = store.add(P.REQ_COUNT, 1)
    req = {
        "host": host_id(cenv.master_addr),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "node_id": os.environ.get("MS_NODE_ID") or None,
        "rank_hint": _optional_int("AUTOPAR_RANK"),
        "world_size": cenv.world_size,
        "auth": P.auth_code(os.environ.get("AUTOPAR_JOB_TOKEN"), n),
    }
    store.set(P.req_key(n), P.dumps(req))
    if not _wait_key(store, P.resp_key(n), deadline):
        raise ClusterError(
            f"only {_joined(store)} of {cenv.world_size} workers joined within {timeout:.0f} s (AUTOPAR_CLUSTER_TIMEOUT)"
        )
    resp = P.loads(store.get(P.resp_key(n)))
    if "error" in resp:
        raise ClusterError(resp["error"])
    rank = int(resp["rank"])
    if not _wait_key(store, P.READY, deadline):
        raise ClusterError(
            f"only {_joined(store)} of {cenv.world_size} workers joined within {timeout:.0f} s (AUTOPAR_CLUSTER_TIMEOUT)"
        )
    hosts = P.loads(store.get(P.READY))["hosts"]
    return store, rank, hosts


def _watch_exit_calls(watchdog: "Watchdog") -> None:
    """Let ``sys.exit(3)`` (and the ``exit``/``quit`` builtins) count as a failure in the end-of-process report.

    Why: a script started by hand under the MindSpore contract has no parent of ours that sees its exit status;
    the atexit report is all the scheduler learns, and atexit cannot see the status a ``SystemExit`` carries.
    So the calls that raise it note the status first. Left out: a bare ``raise SystemExit(3)``, and a
    ``sys.exit(3)`` the script catches itself (it is still reported as failed). Under ``autopar launch`` the
    supervisor reads real exit statuses as well.
    """
    watch_exit_calls(watchdog.note_exit_status)


def _pytest_config():
    """The pytest ``Config`` collecting this script, when ``init()`` runs inside ``pytest script.py`` (found on
    the calling frames: pytest keeps no global one)."""
    if "_pytest" not in sys.modules:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        for name in ("config", "self", "session"):
            obj = frame.f_locals.get(name)
            obj = obj if type(obj).__name__ == "Config" else getattr(obj, "config", None)
            if type(obj).__name__ == "Config" and type(obj).__module__.startswith("_pytest"):
                return obj
        frame = frame.f_back
    return None


def _watch_pytest_status(watchdog: "Watchdog") -> None:
    """MindSpore's r1.x/r2.1 run scripts start each rank as ``pytest -s -v script.py``: a failed test there ends
    the process with pytest's status, which no ``sys.exit`` call carries -- note it from pytest's session end."""
    config = _pytest_config()
    if config is None:
        return

    class _Status:
        def pytest_sessionfinish(self, session, exitstatus):
            watchdog.note_exit_status(int(exitstatus))

    try:
        config.pluginmanager.register(_Status(), "autopar-rank-status")
    except Exception:  # noqa: BLE001 - a pytest we do not know: the atexit report stays as it is
        pass


class Watchdog:
    """Heartbeat + abort watcher + end-of-process report for one registered worker."""

    def __init__(self, cenv: ClusterEnv, rank: int):
        self.cenv = cenv
        self.rank = rank
        self.failure: str | None = None
        self.exit_status: int | None = None  # the status sys.exit() was given, when not 0
        self.abort_reason: str | None = None
        self._stop = threading.Event()
        self._reported = False
        self._lock = threading.Lock()
        self._io = threading.Lock()  # one store client, two threads (watchdog, main at exit): one call at a time
        # A connection of its own: the main thread may be blocked in the store (e.g. process-group setup).
        self.store = connect(cenv, 30.0)
        self.line = self._open_line()
        self.thread = threading.Thread(target=self._loop, name="autopar-watchdog", daemon=True)
        self._call_since: float | None = None  # when the watchdog's store call in progress began
        self.deadman = threading.Thread(target=self._deadman, name="autopar-deadman", daemon=True)

    def _open_line(self) -> socket.socket | None:
        """A plain connection to the scheduler that never carries a byte: when the scheduler's process dies, its
        kernel closes it and it reads as ended -- seen without a store call. A store call on the connection of a
        dead scheduler makes c10d log a warning with a C++ stack dump first (hand-started jobs do not set
        ``TORCH_CPP_LOG_LEVEL``, and torch reads it only at import)."""
        try:
            line = socket.create_connection((self.cenv.master_addr, self.cenv.master_port), timeout=5.0)
        except OSError:
            return None
        line.setblocking(False)
        return line

    def _scheduler_closed(self) -> bool:
        """Has the scheduler's end of the silent connection closed (its process died)?"""
        if self.line is None:
            return False
        try:
            readable, _, _ = select.select([self.line], [], [], 0)
            return bool(readable) and self.line.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def start(self) -> None:
        self.thread.start()
        self.deadman.start()
        atexit.register(self.report_exit)
        _watch_exit_calls(self)
        _watch_pytest_status(self)

    def note_exit_status(self, status: object) -> None:
        """``sys.exit(status)`` / ``exit(status)`` was called: a status other than 0/None is this rank's failure."""
        if status is None or status == 0 or self.failure:
            return
        self.failure = f"exited with status {status}" if isinstance(status, int) else f"exited: {status}"
        self.exit_status = status if isinstance(status, int) else 1

    def _loop(self) -> None:
        last_ok = time.monotonic()
        limit = heartbeat_timeout()
        while not self._stop.wait(P.HEARTBEAT_INTERVAL):
            if self._scheduler_closed() and not self._stop.is_set():
                self._die(self._lost_scheduler())
            try:
                with self._io:
                    self._call_since = time.monotonic()
                    try:
                        self.store.add(P.hb_key(self.rank), 1)
                        aborted = self.store.check([P.ABORT])
                        reason = self.store.get(P.ABORT).decode() if aborted else None
                    finally:
                        self._call_since = None
                last_ok = time.monotonic()
            except Exception:
                if self._stop.is_set():
                    continue
                if port_refused(self.cenv.master_addr, self.cenv.master_port):
                    self._die(self._lost_scheduler())  # nothing listens any more: the scheduler is gone
                if time.monotonic() - last_ok > min(limit, 5.0):
                    self._die(self._lost_scheduler())
                self._reconnect()  # it still listens: a connection that broke, not the scheduler
                continue
            if reason is not None and not self._stop.is_set():
                self.abort_reason = reason
                self._report("aborted", f"aborted: {reason}")
                self._die(f"job aborted ({reason}); rank {self.rank} stops")

    def _reconnect(self) -> None:
        """A fresh store connection (each call on a broken one would fail again, with a C++ dump each time)."""
        try:
            store = dist.TCPStore(self.cenv.master_addr, self.cenv.master_port, None, False,
                                  timeout=P.seconds(P.STORE_OP_TIMEOUT_S))
        except Exception:
            return
        with self._io:
            self.store = store

    def _deadman(self) -> None:
        """Stop the process when a store call of the watchdog hangs: across hosts a pulled cable or a powered-off
        scheduler host resets nothing, and a blocked socket read would wait (and the ranks' collectives with it)
        for as long as TCP retransmits -- many minutes. The scheduler gives up on a silent rank after the same
        ``AUTOPAR_HEARTBEAT_TIMEOUT``."""
        limit = max(heartbeat_timeout(), P.STORE_OP_TIMEOUT_S)
        while not self._stop.wait(0.5):
            since = self._call_since
            if since is not None and time.monotonic() - since > limit:
                self._call_since = None
                self._die(self._lost_scheduler() + f" (no answer for {limit:.0f} s)")

    def wait_for_abort(self, timeout: float) -> str | None:
        """After a collective failed: did the job abort because of another rank, or lose its scheduler?

        The watchdog thread alone talks to the store (a TCPStore client is not safe to share between threads):
        this waits for its verdict. On an abort or a lost scheduler the watchdog reports and exits the process
        itself, naming the root cause; None means nothing happened within ``timeout`` -- this rank's own fault.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.thread.is_alive():
            if self.abort_reason is not None:
                return self.abort_reason
            time.sleep(0.1)
        return self.abort_reason

    def ended_ranks(self, world: int) -> dict[int, str]:
        """{rank: how it ended} of the other ranks that already reported their end ("ok", "failed: ..."): who left
        a collective this rank is still in."""
        out: dict[int, str] = {}
        if not self._io.acquire(timeout=P.STORE_OP_TIMEOUT_S):
            return out
        try:
            for r in range(world):
                if r != self.rank and self.store.check([P.done_key(r)]):
                    done = P.loads(self.store.get(P.done_key(r)))
                    status = done.get("status", "ended")
                    out[r] = CLEAN_END if status == "ok" else str(done.get("detail") or status)
        except Exception:
            pass  # the scheduler is gone: nothing to name
        finally:
            self._io.release()
        return out

    def stop_as_secondary(self, reason: str) -> None:
        """This rank failed only because another did: say so, report "aborted", and exit with EXIT_ABORTED."""
        self._stop.set()
        self._report("aborted", f"aborted: {reason}")
        self._die(f"job aborted ({reason}); rank {self.rank} stops")

    def _lost_scheduler(self) -> str:
        return f"lost the scheduler at {self.cenv.master_addr}:{self.cenv.master_port}; stopping"

    def _die(self, message: str) -> None:
        try:
            sys.stdout.flush()
        except Exception:
            pass
        # Straight to fd 2: sys.stderr may be mid-write in another thread, or gone during interpreter shutdown.
        os.write(2, f"autopar: error: {message}\n".encode())
        os._exit(P.EXIT_ABORTED)

    def _report(self, status: str, detail: str | None) -> None:
        with self._lock:
            if self._reported:
                return
            self._reported = True
            if not self._io.acquire(timeout=P.STORE_OP_TIMEOUT_S):
                return  # the watchdog's call hangs (the deadman ends the process): waiting would only hang too
            try:
                self.store.set(P.done_key(self.rank), P.dumps({"status": status, "detail": detail}))
            except Exception:
                pass  # the scheduler is gone; nobody is left to tell
            finally:
                self._io.release()

    def report_exit(self) -> None:
        """atexit: tell the scheduler whether this rank ended cleanly (an unhandled exception counts as failed).

        The watchdog thread is joined first: a daemon thread still inside a store call when the interpreter
        finalizes is killed by a forced unwind through C++ frames, and the process aborts ("terminate called
        without an active exception", SIGABRT) after it had finished cleanly."""
        self._stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=P.STORE_OP_TIMEOUT_S + 1.0)
        stuck = self.thread.is_alive() and self.thread is not threading.current_thread()
        if self.failure:
            self._report("failed", self.failure)
            mark_end("failed")
        else:
            self._report("ok", None)
            mark_end("ok")
        if stuck:  # still blocked in a store call (a scheduler that stopped answering): finalizing would abort
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(self.exit_status if self.exit_status is not None else (1 if self.failure else 0))
