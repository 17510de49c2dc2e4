"""The MindSpore-style scheduler (``MS_ROLE=MS_SCHED``): hosts the rendezvous and watches the job.

In the scheduler process ``autopar.init()`` never returns: it admits ``MS_WORKER_NUM`` workers (assigning ranks
0..N-1), then waits until every worker has finished, and ends the process with 0 only if all succeeded; otherwise
it names the failed ranks and exits non-zero. If a worker dies (no heartbeat) or fails, the scheduler publishes
an abort so that the other workers stop instead of hanging in a collective.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import NoReturn

import torch.distributed as dist

from autopar.cluster import protocol as P
from autopar.cluster.env import ClusterEnv, cluster_timeout, heartbeat_timeout
from autopar.cluster.netutil import bind_listener
from autopar.errors import ClusterError

POLL = 0.2
ADMIT_POLL = 0.02  # while workers join (on the path from launch to the first step): answer them quickly


def _log(msg: str) -> None:
    print(f"[autopar scheduler] {msg}", flush=True)


@dataclass
class _Admission:
    """Decides, request by request, who gets which rank."""

    world_size: int
    token: str | None
    owners: dict[int, str] = field(default_factory=dict)  # rank -> description of the worker
    node_ids: dict[str, int] = field(default_factory=dict)  # MS_NODE_ID -> rank
    hosts: dict[int, str] = field(default_factory=dict)
    pending: list[tuple[int, dict]] = field(default_factory=list)  # unhinted requests, waiting for all N

    def decide(self, n: int, req: dict) -> dict | None:
        """Return the response for request n, or None when it must wait for the other workers."""
        who = f"{req.get('hostname', '?')}:{req.get('pid', '?')}"
        if not P.auth_ok(self.token, n, req.get("auth")):
            return {"error": "refused: this process does not carry the job's token (AUTOPAR_JOB_TOKEN)"}
        if req.get("world_size") != self.world_size:
            return {
                "error": f"MS_WORKER_NUM={req.get('world_size')} on this worker but the scheduler "
                f"expects {self.world_size} workers"
            }
        node_id = req.get("node_id")
        if node_id and node_id in self.node_ids:
            return {"error": f"worker MS_NODE_ID={node_id!r} registered twice (already rank {self.node_ids[node_id]})"}
        hint = req.get("rank_hint")
        if hint is not None:
            if not 0 <= hint < self.world_size:
                return {"error": f"rank {hint} is beyond the world size {self.world_size}"}
            if hint in self.owners:
                return {"error": f"rank {hint} registered twice (already taken by {self.owners[hint]})"}
            if len(self.owners) + len(self.pending) >= self.world_size:
                return {"error": f"the job already has {self.world_size} workers; refusing an extra one"}
            self._admit(hint, who, req)
            return {"rank": hint}
        if len(self.owners) + len(self.pending) >= self.world_size:
            return {"error": f"the job already has {self.world_size} workers; refusing an extra one"}
        self.pending.append((n, req))
        return None

    def _admit(self, rank: int, who: str, req: dict) -> None:
        self.owners[rank] = who
        self.hosts[rank] = req.get("host") or req.get("hostname") or "?"
        if req.get("node_id"):
            self.node_ids[req["node_id"]] = rank

    def settle_pending(self) -> list[tuple[int, dict]]:
        """Once N workers asked, give the unhinted ones the free ranks in order of arrival."""
        if len(self.owners) + len(self.pending) < self.world_size:
            return []
        free = [r for r in range(self.world_size) if r not in self.owners]
        answers = []
        for (n, req), rank in zip(self.pending, free):
            self._admit(rank, f"{req.get('hostname', '?')}:{req.get('pid', '?')}", req)
            answers.append((n, {"rank": rank}))
        self.pending = []
        return answers

    @property
    def complete(self) -> bool:
        return len(self.owners) == self.world_size


class Scheduler:
    """Runs the whole life of the job from the scheduler's side; :meth:`run` returns the exit code."""

    def __init__(self, cenv: ClusterEnv, listen_fd: int | None = None, token: str | None = None,
                 supervised: bool = False):
        """``supervised``: started by ``autopar launch``, which watches the workers' processes itself. Then the
        join timeout starts with the first registration: a script that never calls ``init()`` (or a torchrun-style
        one that forms torch's world by itself) is not a job that failed to form."""
        self.cenv = cenv
        self.supervised = supervised
        self.world_size = cenv.world_size
        self._sock: socket.socket | None = None
        if listen_fd is None:
            self._sock = bind_listener(cenv.master_addr, cenv.master_port)
            listen_fd = self._sock.fileno()
        try:
            self.store = dist.TCPStore(
                cenv.master_addr,
                cenv.master_port,
                None,
                True,
                timeout=P.seconds(30),
                wait_for_workers=False,
                master_listen_fd=listen_fd,
            )
        except Exception as exc:  # torch raises DistNetworkError with a C++ dump
            raise ClusterError(f"scheduler cannot listen on {cenv.master_addr}:{cenv.master_port}: {P.first_line(exc)}") from None
        self.admission = _Admission(self.world_size, token)
        self.next_req = 1
        self.join_timeout = cluster_timeout()
        self.hb_timeout = heartbeat_timeout()

    # -- admission -----------------------------------------------------------------------------------------------
    def _serve_requests(self) -> None:
        count = self.store.add(P.REQ_COUNT, 0)
        while self.next_req <= count:
            key = P.req_key(self.next_req)
            if not self.store.check([key]):
                return  # the worker has taken a number but not written its request yet
            n = self.next_req
            self.next_req += 1
            try:
                req = P.loads(self.store.get(key))
            except ValueError:
                self.store.set(P.resp_key(n), P.dumps({"error": "malformed registration"}))
                continue
            answer = self.admission.decide(n, req)
            answers = [(n, answer)] if answer is not None else []
            answers += self.admission.settle_pending()
            for m, ans in answers:
                if "rank" in ans:
                    self.store.set(P.admitted_key(ans["rank"]), "1")
                self.store.set(P.resp_key(m), P.dumps(ans))
                if "rank" in ans:
                    _log(f"worker admitted as rank {ans['rank']}")
                else:
                    _log(f"registration refused: {ans['error']}")
            self.store.set(P.JOINED, str(len(self.admission.owners) + len(self.admission.pending)))

    def _admit_all(self) -> bool:
        deadline = None if self.supervised else time.monotonic() + self.join_timeout
        while not self.admission.complete:
            self._serve_requests()
            if deadline is None and self.next_req > 1:
                deadline = time.monotonic() + self.join_timeout  # the first worker asked: the clock runs
            if deadline is not None and time.monotonic() > deadline:
                joined = len(self.admission.owners) + len(self.admission.pending)
                reason = (
                    f"only {joined} of {self.world_size} workers joined within {self.join_timeout:.0f} s "
                    f"(AUTOPAR_CLUSTER_TIMEOUT)"
                )
                self.store.set(P.ABORT, reason)
                print(f"autopar: error: {reason}", file=sys.stderr, flush=True)
                return False
            time.sleep(ADMIT_POLL)
        hosts = [self.admission.hosts[r] for r in range(self.world_size)]
        self.store.set(P.READY, P.dumps({"hosts": hosts}))
        _log(f"all {self.world_size} workers joined")
        return True

    # -- supervision ---------------------------------------------------------------------------------------------
    def _supervise(self) -> dict[int, str]:
        """Wait for every rank to finish; return {rank: failure description} for the ones that did not succeed."""
        now = time.monotonic()
        last_beat = {r: (0, now) for r in range(self.world_size)}
        finished: dict[int, dict] = {}
        failures: dict[int, str] = {}
        while len(finished) < self.world_size:
            self._serve_requests()  # late or extra workers get an answer instead of hanging
            now = time.monotonic()
            for r in range(self.world_size):
                if r in finished:
                    continue
                if self.store.check([P.done_key(r)]):
                    finished[r] = P.loads(self.store.get(P.done_key(r)))
                    status = finished[r].get("status")
                    if status != "ok":
                        failures[r] = finished[r].get("detail") or status
                    _log(f"rank {r} finished: {status}" + (f" ({failures[r]})" if r in failures else ""))
                    continue
                beat = self.store.add(P.hb_key(r), 0)
                if beat != last_beat[r][0]:
                    last_beat[r] = (beat, now)
                elif now - last_beat[r][1] > self.hb_timeout:
                    finished[r] = {"status": "dead"}
                    failures[r] = f"no heartbeat for {self.hb_timeout:.0f} s: the process died or hangs"
                    _log(f"rank {r} lost: {failures[r]}")
            if failures and not self.store.check([P.ABORT]):
                self.store.set(P.ABORT, self.describe(failures))
            time.sleep(POLL)
        return failures

    def run(self) -> int:
        self.store.set(P.JOB, P.dumps({"world_size": self.world_size}))
        _log(f"listening on {self.cenv.master_addr}:{self.cenv.master_port} for {self.world_size} workers")
        if not self._admit_all():
            self._linger()
            return 1
        failures = self._supervise()
        root = {r: d for r, d in failures.items() if "aborted" not in d}
        if not failures:
            _log("job succeeded")
            return 0
        print(f"autopar: error: job failed ({self.describe(root or failures)})", file=sys.stderr, flush=True)
        return 1

    def describe(self, failures: dict[int, str]) -> str:
        """The failed ranks in one line; a host whose every rank went silent is named as lost with its ranks
        (a host that vanished -- power, cable, all its processes killed -- not one process that crashed)."""
        hosts = self.admission.hosts
        parts, done = [], set()
        for r in sorted(failures):
            if r in done:
                continue
            host = hosts.get(r, "?")
            on_host = [q for q in range(self.world_size) if hosts.get(q) == host]
            silent = [q for q in on_host if failures.get(q, "").startswith("no heartbeat")]
            if len(on_host) > 1 and silent == on_host:
                parts.append(f"host {host} lost: ranks {', '.join(map(str, on_host))} silent for "
                             f"{self.hb_timeout:.0f} s (the host, its network or all its processes are gone)")
                done.update(on_host)
            else:  # ranks that failed alike (a configuration every rank reads) are one entry
                alike = [q for q in sorted(failures) if q not in done and failures[q] == failures[r]]
                where = {hosts.get(q, "?") for q in alike}
                who = (f"rank {r} on {host}" if len(alike) == 1 else
                       f"{'every rank' if len(alike) == self.world_size else 'ranks'} "
                       f"({', '.join(map(str, alike))}) on {', '.join(sorted(where))}")
                parts.append(f"{who}: {failures[r]}")
                done.update(alike)
        return "; ".join(parts)

    def _linger(self, seconds: float = 3.0) -> None:
        """Keep the store up briefly so that waiting workers read the abort reason instead of a dead socket."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._serve_requests()
            time.sleep(POLL)


def run_scheduler(cenv: ClusterEnv) -> "NoReturn":  # noqa: F821
    """Entry of ``init()`` in the scheduler role: never returns to user code."""
    scheduler = Scheduler(cenv, token=os.environ.get("AUTOPAR_JOB_TOKEN") or None)
    code = scheduler.run()
    sys.stdout.flush()
    if "_pytest" in sys.modules:
        # started as ``pytest -s -v script.py`` (MindSpore's r1.x/r2.1 run scripts): init() runs while pytest collects
        # the script, and pytest turns a SystemExit there into INTERNALERROR (exit 3) -- end with the job's status
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
