"""``autopar launch``: start this host's share of a job and supervise it.

Two ways to form the job, both exactly what a hand-written script would do:

- the **MindSpore dynamic cluster** (default): node 0 runs the scheduler (what ``MS_ROLE=MS_SCHED`` runs, in a
  child forked from the launcher) and every node its workers (``MS_ROLE=MS_WORKER``, ``MS_WORKER_NUM``,
  ``MS_SCHED_HOST``, ``MS_SCHED_PORT``), so a ``run.sh`` is interchangeable with it. One node: the scheduler
  listens on 127.0.0.1, on a port reserved race-free (the bound socket is inherited through the fork). Several
  nodes (``--nnodes/--node-rank/--master-addr/--master-port`` or a ``--hostfile``): it listens on the master
  address; workers get consecutive ranks per node.
- a **rank table** (``--rank-table FILE --server-id ID``): one process per device of this server, with
  ``RANK_TABLE_FILE``/``RANK_ID``/``DEVICE_ID``/``RANK_SIZE`` as the tutorials' run.sh; no scheduler.

Every worker also gets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` -- a port of its own, where rank 0 hosts torch's store --,
``TORCHELASTIC_RUN_ID``), so an unmodified torchrun script forms one world with ``init_process_group()``; autopar's
``init()`` reads the MindSpore variables first and forms the same one world (never two).

Every job carries a random token (``AUTOPAR_JOB_TOKEN``; give the same ``--token`` on every node): the scheduler
admits no process without it. Logs go to ``LOG_DIR/{scheduler,worker_<rank>,env_<rank>}.log``; the console shows
every local rank's lines, each prefixed ``[rank N]`` (``--console-ranks`` narrows it). ``--max-restarts K`` runs the whole job again after a failure (scripts resume from their newest
checkpoint, e.g. ``Model.train(resume_from=...)``; ``AUTOPAR_RESTART`` tells them which attempt it is).
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from autopar.cluster.netutil import (
    bind_listener,
    free_port,
    interface_towards,
    local_addresses,
    port_open,
    port_refused,
)
from autopar.cluster.supervisor import (  # noqa: F401 (re-exported)
    JobProbe,
    Streamer,
    Supervisor,
    describe_exit,
    tail,
)
from autopar.errors import ClusterError

DEFAULT_MASTER_PORT = 29500
# Seconds the workers wait to reach the scheduler and for every worker to join: torchrun's rendezvous waits 600 s
# (its join timeout), and so does msrun (--cluster_time_out) -- long enough for the nodes of a job to be started
# one after another by hand, short enough that a mistyped address fails within minutes.
DEFAULT_CLUSTER_TIMEOUT = 600


@dataclass
class LaunchConfig:
    nproc: int
    script: str
    script_args: list[str] = field(default_factory=list)
    log_dir: str = "autopar_logs"
    port: int | None = None
    host: str = "127.0.0.1"
    python: str = sys.executable
    stream_ranks: list[int] | None = None  # the ranks whose output the console shows (None: every local rank)
    grace: float = 10.0  # seconds between SIGTERM and SIGKILL when stopping the job
    extra_env: dict[str, str] = field(default_factory=dict)
    # several hosts
    nnodes: int = 1
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    token: str | None = None
    hostfile: str | None = None
    # rank table
    rank_table: str | None = None
    server_id: str | None = None
    # faults
    max_restarts: int = 0
    cluster_timeout: float | None = None  # None: AUTOPAR_CLUSTER_TIMEOUT if set, else DEFAULT_CLUSTER_TIMEOUT


@dataclass
class _Layout:
    """This host's share: which ranks it runs, how many in total, and where the rendezvous is."""

    world: int
    ranks: list[int]
    master_addr: str
    master_port: int | None
    host_id: str
    scheduler_here: bool
    rank_table: object | None = None
    node: int = 0  # this host's index (torchrun's GROUP_RANK)


def _check_port(value: int | None, flag: str, zero_ok: bool = False) -> None:
    if value is None or (zero_ok and value == 0):
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ClusterError(f"{flag} {value} is not a TCP port (1..65535)")


def _validate(cfg: LaunchConfig) -> None:
    _check_port(cfg.port, "--port", zero_ok=True)
    _check_port(cfg.master_port, "--master-port")
    if cfg.max_restarts < 0:
        raise ClusterError(f"--max-restarts must be 0 or more, got {cfg.max_restarts}")
    if cfg.cluster_timeout is not None and not cfg.cluster_timeout > 0:
        raise ClusterError(f"--cluster-timeout must be a positive number of seconds, got {cfg.cluster_timeout:g}")


def _resolve(cfg: LaunchConfig) -> _Layout:
    _validate(cfg)
    if cfg.rank_table:
        from autopar.cluster.ranktable import load_rank_table

        if not cfg.server_id:
            raise ClusterError("--rank-table needs --server-id (this host's server_id in the table)")
        table = load_rank_table(cfg.rank_table)
        ranks = list(table.ranks_on(cfg.server_id))
        addr = cfg.master_addr or os.environ.get("MASTER_ADDR") or table.master_addr
        port = cfg.master_port or int(os.environ.get("MASTER_PORT") or DEFAULT_MASTER_PORT)
        return _Layout(table.world_size, ranks, addr, port, cfg.server_id, False, table,
                       node=table.node_rank(cfg.server_id))
    if cfg.hostfile:
        from autopar.cluster.hostfile import load_hostfile, node_rank_of, rank_range, world_size

        hosts = load_hostfile(cfg.hostfile)
        node = cfg.node_rank if cfg.node_rank is not None else _find_self(hosts, node_rank_of)
        if not 0 <= node < len(hosts):
            raise ClusterError(f"--node-rank {node} is outside the {len(hosts)} hosts of {cfg.hostfile}")
        ranks = list(rank_range(hosts, node))
        addr = cfg.master_addr or hosts[0].host
        return _Layout(world_size(hosts), ranks, addr, cfg.master_port or cfg.port, f"{hosts[node].host}/{node}",
                       node == 0, node=node)
    node = cfg.node_rank or 0
    if cfg.nproc < 1:
        raise ClusterError(f"-n must be a positive number of workers, got {cfg.nproc}")
    if cfg.nnodes < 1 or not 0 <= node < cfg.nnodes:
        raise ClusterError(f"--node-rank {node} is outside 0..{cfg.nnodes - 1} (--nnodes {cfg.nnodes})")
    if cfg.nnodes > 1 and not (cfg.master_addr and cfg.master_port):
        raise ClusterError("several nodes need --master-addr and --master-port (where node 0's scheduler listens)")
    first = node * cfg.nproc
    addr = cfg.master_addr or cfg.host
    host_id = f"{socket.gethostname()}/{node}"
    if cfg.nnodes > 1 and (route := interface_towards(addr)) is not None:
        host_id += f" ({route[1]})"  # host names repeat (containers, cloned images); the address names the host
    return _Layout(cfg.nnodes * cfg.nproc, list(range(first, first + cfg.nproc)), addr, cfg.master_port or cfg.port,
                   host_id, node == 0, node=node)


def _find_self(hosts, node_rank_of) -> int:
    """This host's line: by its names, then by its addresses -- a hostfile may list names this host does not call
    itself (cluster DNS, /etc/hosts aliases) or addresses; each entry is then resolved and compared."""
    names = [socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1"]
    for name in names:
        try:
            return node_rank_of(hosts, name)
        except ClusterError:
            continue
    mine = set(local_addresses()) - {"127.0.0.1", "::1"}
    for i, h in enumerate(hosts):
        try:
            resolved = {info[4][0] for info in socket.getaddrinfo(h.host, None, type=socket.SOCK_STREAM)}
        except socket.gaierror:
            continue
        if resolved & mine:
            return i
    raise ClusterError(f"this host ({socket.gethostname()}, {', '.join(sorted(mine)) or 'no address'}) is not in "
                       f"the hostfile: give --node-rank")


class _StoreProbe(JobProbe):
    """Asks the scheduler's store which ranks were admitted (a client connection, opened when first needed)."""

    def __init__(self, addr: str, port: int | None):
        self.addr, self.port = addr, port
        self.store = None

    def _get(self):
        if self.store is None and self.port and port_open(self.addr, self.port):
            import torch.distributed as dist

            from autopar.cluster import protocol as P

            try:
                self.store = dist.TCPStore(self.addr, self.port, None, False, timeout=P.seconds(5))
            except Exception:
                self.store = None
        return self.store

    def _ask(self, question) -> bool | None:
        if self.port and port_refused(self.addr, self.port):  # the scheduler is gone: a call on its broken
            self.store = None  # connection would print a C++ stack dump on this console
            return None
        store = self._get()
        if store is None:
            return None
        try:
            return bool(question(store))
        except Exception:
            self.store = None
            return None

    def admitted(self, rank: int) -> bool | None:
        from autopar.cluster import protocol as P

        return self._ask(lambda store: store.check([P.admitted_key(rank)]))

    def anyone(self) -> bool | None:
        """Has any worker asked to join (registration requests are numbered from 1)?"""
        from autopar.cluster import protocol as P

        return self._ask(lambda store: store.add(P.REQ_COUNT, 0) > 0)


def prepare_log_dir(path: str) -> Path:
    """The log directory, created; a one-line error where it cannot be (a file in the way, no permission)."""
    log_dir = Path(path).resolve()
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ClusterError(f"--log-dir {path}: a file is in the way (it must be a directory)") from None
    except OSError as exc:
        raise ClusterError(f"--log-dir {path}: cannot create it: {exc.strerror}") from None
    if not os.access(log_dir, os.W_OK | os.X_OK):
        raise ClusterError(f"--log-dir {path}: not writable")
    return log_dir


class Launcher:
    def __init__(self, cfg: LaunchConfig):
        if not Path(cfg.script).is_file():
            raise ClusterError(f"script not found: {cfg.script}" + (" (a directory)" if Path(cfg.script).is_dir()
                                                                     else ""))
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir).resolve()
        self.layout = _resolve(cfg)
        self.token = cfg.token or os.environ.get("AUTOPAR_JOB_TOKEN") or None
        if self.token is None and self.layout.rank_table is None:
            if cfg.nnodes > 1 and not self.layout.scheduler_here:
                raise ClusterError("this node joins another node's job: give the job's --token (printed by node 0)")
            self.token = secrets.token_hex(16)
            if cfg.nnodes > 1 or cfg.hostfile:
                print(f"[autopar] job token: {self.token} (give --token {self.token} on the other nodes)", flush=True)
        self._interrupted: int | None = None
        self.launch_id = secrets.token_hex(8)
        self.torch_port: int | None = None  # MASTER_PORT for torchrun-style scripts

    # -- environment ---------------------------------------------------------------------------------------------
    def _base_env(self, attempt: int) -> dict[str, str]:
        env = dict(os.environ)
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "RANK_TABLE_FILE",
                    "MINDSPORE_HCCL_CONFIG_PATH", "MS_ROLE", "RANK_ID", "DEVICE_ID", "RANK_SIZE",
                    "OMPI_COMM_WORLD_RANK"):
            env.pop(var, None)  # the contract of this launch takes over; stale variables would only confuse
        local = len(self.layout.ranks)
        env.update(AUTOPAR_LOG_DIR=str(self.log_dir), PYTHONUNBUFFERED="1", AUTOPAR_RESTART=str(attempt),
                   AUTOPAR_HOST_ID=self.layout.host_id, AUTOPAR_LAUNCH_ID=self.launch_id,
                   TORCHELASTIC_RESTART_COUNT=str(attempt), TORCHELASTIC_MAX_RESTARTS=str(self.cfg.max_restarts))
        # c10d logs a C++ stack dump with each warning (a store connection that broke when the job ends): only
        # its errors reach the logs, unless the user chose a level
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        # a rank killed by a signal (a crash in native code: a segfault, glibc's heap checks aborting) writes the
        # Python stack of each of its threads into its log, not only the signal's name
        env.setdefault("PYTHONFAULTHANDLER", "1")
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores between local workers unless the user chose
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local))
        if self.cfg.cluster_timeout is not None:
            env["AUTOPAR_CLUSTER_TIMEOUT"] = f"{self.cfg.cluster_timeout:g}"
        else:
            env.setdefault("AUTOPAR_CLUSTER_TIMEOUT", str(DEFAULT_CLUSTER_TIMEOUT))
        env.update(self.cfg.extra_env)
        return env

    def _torchrun_env(self, rank: int, master_port: int | None) -> dict[str, str]:
        """torchrun's variables for one worker: ``init_process_group()`` (env://) forms the job's one world."""
        lay = self.layout
        if self.torch_port is None:
            if lay.rank_table is not None:
                self.torch_port = master_port  # the rank table's rendezvous port is torchrun's MASTER_PORT already
            elif self.cfg.nnodes > 1 or self.cfg.hostfile:
                self.torch_port = master_port + 1  # nodes agree without talking: the port after the scheduler's
            else:
                self.torch_port = free_port(lay.master_addr)
        return {"RANK": str(rank), "LOCAL_RANK": str(lay.ranks.index(rank)), "WORLD_SIZE": str(lay.world),
                "LOCAL_WORLD_SIZE": str(len(lay.ranks)), "GROUP_RANK": str(lay.node), "MASTER_ADDR": lay.master_addr,
                "MASTER_PORT": str(self.torch_port), "TORCHELASTIC_RUN_ID": self.launch_id}

    def _write_env(self, rank: int, env: dict[str, str]) -> None:
        (self.log_dir / f"env_{rank}.log").write_text("".join(f"{k}={v}\n" for k, v in sorted(env.items())))

    # -- one attempt --------------------------------------------------------------------------------------------
    def _start(self, sup: Supervisor, attempt: int) -> str:
        lay, env = self.layout, self._base_env(attempt)
        if lay.rank_table is not None:
            env.update(RANK_TABLE_FILE=str(Path(self.cfg.rank_table).resolve()), RANK_SIZE=str(lay.world),
                       MASTER_ADDR=lay.master_addr, MASTER_PORT=str(lay.master_port))
            for rank in lay.ranks:
                wenv = {**env, **self._torchrun_env(rank, lay.master_port), "RANK_ID": str(rank),
                        "DEVICE_ID": str(lay.rank_table.entry(rank).device_id)}
                self._write_env(rank, wenv)
                sup.spawn(f"worker_{rank}", rank, wenv)
            return f"rank table {self.cfg.rank_table}, server {self.cfg.server_id}, rendezvous at " \
                   f"{lay.master_addr}:{lay.master_port}"
        env.update(MS_WORKER_NUM=str(lay.world), MS_SCHED_HOST=lay.master_addr, AUTOPAR_JOB_TOKEN=self.token)
        listener = None
        if lay.scheduler_here:
            listener = bind_listener(lay.master_addr, lay.master_port or 0)
            port = listener.getsockname()[1]
        else:
            port = lay.master_port
        env["MS_SCHED_PORT"] = str(port)
        try:
            if listener is not None:
                sup.fork("scheduler", None, partial(_run_scheduler, lay.world, lay.master_addr, port,
                                                     listener.fileno(), self.token))
            sup.probe = _StoreProbe(lay.master_addr, port)
        finally:
            if listener is not None:
                listener.close()
        for rank in lay.ranks:
            wenv = {**env, **self._torchrun_env(rank, port), "MS_ROLE": "MS_WORKER", "AUTOPAR_RANK": str(rank)}
            self._write_env(rank, wenv)
            sup.spawn(f"worker_{rank}", rank, wenv)
        where = "scheduler" if lay.scheduler_here else "joining the scheduler"
        return f"{where} on {lay.master_addr}:{port}"

    def _attempt(self, attempt: int) -> int:
        command = [self.cfg.python, self.cfg.script, *self.cfg.script_args]
        sup = Supervisor(command, self.log_dir, self.cfg.grace, janitor=self.janitor)
        self.supervisor = sup
        streamer = None
        old = {s: signal.signal(s, lambda signum, frame: setattr(sup, "interrupted", signum))
               for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                where = self._start(sup, attempt)
            except OSError as exc:  # a full disk or a log directory gone: the logs cannot be written
                raise ClusterError(f"cannot write the job's logs in {self.log_dir}: {exc.strerror}") from None
            print(f"[autopar] launched ranks {_span(self.layout.ranks)} of {self.layout.world} ({where}); "
                  f"logs in {self.log_dir}", flush=True)
            shown = [r for r in self.layout.ranks if self.cfg.stream_ranks is None or r in self.cfg.stream_ranks]
            if shown:
                streamer = Streamer({r: self.log_dir / f"worker_{r}.log" for r in shown})
                streamer.start()
            code = sup.watch()
        finally:
            sup.stop_all()
            if streamer is not None:
                streamer.finish()
            for s, handler in old.items():
                signal.signal(s, handler)
        if code != 0:
            sup.report()
        return code

    def run(self) -> int:
        self.log_dir = prepare_log_dir(self.cfg.log_dir)
        from autopar.cluster.janitor import Janitor

        self.janitor = Janitor(self.launch_id)  # whatever the job starts goes when this launcher goes
        try:
            for attempt in range(self.cfg.max_restarts + 1):
                code = self._attempt(attempt)
                if code == 0 or code in (130, 143) or attempt == self.cfg.max_restarts:
                    return code
                print(f"[autopar] the job failed ({describe_exit(code) if code < 128 else f'exit {code}'}); "
                      f"restart {attempt + 1} of {self.cfg.max_restarts}", file=sys.stderr, flush=True)
            return code
        finally:
            self.janitor.close()


def _run_scheduler(world: int, addr: str, port: int, listen_fd: int, token: str | None) -> int:
    """The job's scheduler, in a child forked from the launcher: the launcher has imported torch already, so the
    rendezvous is up at once and no second interpreter imports torch and the user's script beside the workers
    (on 2 cores that cost the workers ~1 s of their start)."""
    from autopar.cluster.env import ClusterEnv
    from autopar.cluster.scheduler import Scheduler

    cenv = ClusterEnv(contract="mindspore", role="scheduler", world_size=world, master_addr=addr, master_port=port)
    return Scheduler(cenv, listen_fd=listen_fd, token=token, supervised=True).run()


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}..{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def launch(cfg: LaunchConfig) -> int:
    return Launcher(cfg).run()
