"""Form the cluster for whichever contract started this process, and hand back who we are in it."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch.distributed as dist

from autopar.cluster import protocol as P
from autopar.cluster.env import ClusterEnv, cluster_timeout
from autopar.cluster.netutil import bind_listener, interface_towards, port_open
from autopar.errors import ClusterError

_LISTENERS: list = []


@dataclass
class Membership:
    """This process's place in the job, plus what torch.distributed needs to build the process group."""

    contract: str
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    store: dist.Store | None = None  # rendezvous store for init_process_group(store=...)
    init_method: str | None = None  # used instead of a store (torchrun's env://)
    watchdog: object | None = None  # cluster.worker.Watchdog for MindSpore-contract workers


def _local_position(hosts: list[str], rank: int) -> tuple[int, int]:
    mine = hosts[rank]
    same = [r for r, h in enumerate(hosts) if h == mine]
    return same.index(rank), len(same)


def _mindspore_worker(cenv: ClusterEnv) -> Membership:
    from autopar.cluster.worker import Watchdog, register

    store, rank, hosts = register(cenv)
    local_rank, local_size = _local_position(hosts, rank)
    watchdog = Watchdog(cenv, rank)
    watchdog.start()
    return Membership(
        contract=cenv.contract,
        rank=rank,
        world_size=cenv.world_size,
        local_rank=local_rank,
        local_size=local_size,
        store=dist.PrefixStore(P.PG_PREFIX, store),
        watchdog=watchdog,
    )


def _arrive(store: dist.Store, cenv: ClusterEnv, key: str) -> None:
    """Every rank reaches the rendezvous within ``AUTOPAR_CLUSTER_TIMEOUT``, or one line says how many did: else
    a peer that never started (or died before ``init()``) would keep the others in the process group's
    formation for the whole collective timeout (``AUTOPAR_COMM_TIMEOUT``, 30 minutes by default)."""
    timeout = cluster_timeout()
    deadline = time.monotonic() + timeout
    store.add(key, 1)
    pause = 0.01
    while (arrived := store.add(key, 0)) < cenv.world_size:
        if time.monotonic() > deadline:
            raise ClusterError(
                f"only {arrived} of {cenv.world_size} ranks reached the rendezvous at {cenv.master_addr}:"
                f"{cenv.master_port} within {timeout:.0f} s (AUTOPAR_CLUSTER_TIMEOUT): the others never started, "
                f"or died before init()")
        time.sleep(pause)
        pause = min(0.1, pause * 1.5)


def _static(cenv: ClusterEnv) -> Membership:
    """Contracts where every process already knows its rank (rank table, torchrun, OpenMPI, SLURM): rank 0 hosts a
    TCPStore -- or, under torchrun's elastic agent (``TORCHELASTIC_USE_AGENT_STORE=True``), the agent does and
    every rank is its client, each attempt under its own keys (``TORCHELASTIC_RESTART_COUNT``)."""
    assert cenv.rank is not None
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agent_store else "0"
    hosts = cenv.rank == 0 and not agent_store
    listener = None
    if hosts:  # torch's TCPStore would listen on every interface: listen on the rendezvous address only
        listener = bind_listener(cenv.master_addr, cenv.master_port)
        _LISTENERS.append(listener)  # the store serves on this socket for the life of the process
    else:  # wait with plain sockets: c10d's own connection retries log a C++ stack dump each
        deadline = time.monotonic() + cluster_timeout()
        while not port_open(cenv.master_addr, cenv.master_port, 1.0) and time.monotonic() < deadline:
            time.sleep(0.2)
    try:
        store = dist.TCPStore(
            cenv.master_addr,
            cenv.master_port,
            cenv.world_size,
            hosts,
            timeout=P.seconds(cluster_timeout()),
            wait_for_workers=False,
            **({"master_listen_fd": listener.fileno()} if listener is not None else {}),
        )
    except Exception as exc:
        where = f"{cenv.master_addr}:{cenv.master_port}"
        if hosts:
            raise ClusterError(f"rank 0 cannot host the rendezvous on {where}: {P.first_line(exc)}") from None
        raise ClusterError(
            f"cannot reach rank 0 at {where} within {cluster_timeout():.0f} s (set MASTER_ADDR/MASTER_PORT)"
        ) from None
    _arrive(store, cenv, f"{P.PREFIX}arrived/{attempt}")
    return Membership(
        contract=cenv.contract,
        rank=cenv.rank,
        world_size=cenv.world_size,
        local_rank=cenv.local_rank or 0,
        local_size=cenv.local_size or 1,
        store=dist.PrefixStore(f"{P.PG_PREFIX}{attempt}/", store),
    )


def pin_interface(master_addr: str, env=None) -> str | None:
    """Make gloo use the interface that reaches the rendezvous host (``GLOO_SOCKET_IFNAME``), unless the user chose
    one; returns the interface chosen. See :func:`autopar.cluster.netutil.interface_towards` for why."""
    env = os.environ if env is None else env
    if env.get("GLOO_SOCKET_IFNAME"):
        return None
    found = interface_towards(master_addr)
    if found is None:
        return None
    env["GLOO_SOCKET_IFNAME"] = found[0]
    return found[0]


def form_cluster(cenv: ClusterEnv) -> Membership:
    """Rendezvous with the other processes of the job (workers only; the scheduler never gets here)."""
    if cenv.role != "worker":
        raise ClusterError(f"form_cluster() called in the {cenv.role} role")
    if cenv.contract == "standalone":
        return Membership("standalone", 0, 1, 0, 1, store=dist.HashStore())
    pin_interface(cenv.master_addr)
    if cenv.contract == "mindspore":
        return _mindspore_worker(cenv)
    return _static(cenv)
