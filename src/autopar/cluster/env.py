"""Which launch contract started this process, read from the environment.

The order of precedence is fixed (MindSpore dynamic cluster, rank table, torchrun, OpenMPI, then the cluster
schedulers SLURM and a Kubernetes indexed Job, stand-alone) so that a process started by one launcher never misreads
variables left behind by another: e.g. ``mpirun`` exports ``OMPI_*`` into a torchrun job only if both were nested,
and then torchrun's explicit ``RANK`` wins; an ``mpirun`` or ``autopar launch`` inside a SLURM allocation inherits
the batch step's ``SLURM_PROCID=0``, and its own contract wins. Kubeflow's PyTorchJob and torchrun (elastic) set
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``: the torchrun contract.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Mapping

from autopar.errors import ClusterError

MS_ROLES = ("MS_SCHED", "MS_WORKER")
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class ClusterEnv:
    """What the environment says about this process before any network traffic.

    ``rank`` is None for MindSpore workers: the scheduler assigns it at registration.
    """

    contract: str  # "mindspore" | "ranktable" | "torchrun" | "openmpi" | "slurm" | "kubernetes" | "standalone"
    role: str  # "worker" | "scheduler"
    world_size: int
    rank: int | None = None
    local_rank: int | None = None
    local_size: int | None = None
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT


def _float_env(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ClusterError(f"{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ClusterError(f"{name}={raw!r} must be a positive number of seconds")
    return value


def cluster_timeout(env: Mapping[str, str] = os.environ) -> float:
    """Seconds to reach the scheduler and for all workers to join (``AUTOPAR_CLUSTER_TIMEOUT``, default 300)."""
    return _float_env(env, "AUTOPAR_CLUSTER_TIMEOUT", 300.0)


def heartbeat_timeout(env: Mapping[str, str] = os.environ) -> float:
    """Seconds of silence after which the scheduler declares a worker dead (``AUTOPAR_HEARTBEAT_TIMEOUT``, 10)."""
    return _float_env(env, "AUTOPAR_HEARTBEAT_TIMEOUT", 10.0)


def comm_timeout(env: Mapping[str, str] = os.environ) -> float:
    """Seconds a collective may take before it fails with an error (``AUTOPAR_COMM_TIMEOUT``, default 1800)."""
    return _float_env(env, "AUTOPAR_COMM_TIMEOUT", 1800.0)


def parse_int(env: Mapping[str, str], name: str, *, minimum: int = 0, what: str = "") -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        raise ClusterError(f"{name} is not set{what}")
    try:
        value = int(raw.strip())
    except ValueError:
        raise ClusterError(f"{name}={raw!r} is not an integer{what}") from None
    if value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ClusterError(f"{name}={raw!r} must be {kind}{what}")
    return value


def parse_port(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    if env.get(name) in (None, "") and default is not None:
        return default
    port = parse_int(env, name, minimum=1)
    if port > 65535:
        raise ClusterError(f"{name}={port} is not a TCP port (1..65535)")
    return port


def _mindspore(env: Mapping[str, str]) -> ClusterEnv:
    role = env["MS_ROLE"]
    if role not in MS_ROLES:
        hint = " (parameter-server roles are not supported)" if role in ("MS_PSERVER", "MS_SERVER") else ""
        raise ClusterError(f"unknown MS_ROLE={role!r}: expected one of {', '.join(MS_ROLES)}{hint}")
    world = parse_int(env, "MS_WORKER_NUM", minimum=1, what=" (the number of workers of the job)")
    host = env.get("MS_SCHED_HOST") or DEFAULT_MASTER_ADDR
    port = parse_port(env, "MS_SCHED_PORT")
    return ClusterEnv(
        contract="mindspore",
        role="scheduler" if role == "MS_SCHED" else "worker",
        world_size=world,
        master_addr=host,
        master_port=port,
    )


def _rank_variables(env: Mapping[str, str], contract: str, names: tuple[str, str, str, str],
                    default_port: int) -> ClusterEnv:
    """A launcher that sets rank, world size, local rank and local size in four variables (torchrun, OpenMPI);
    ``names`` = (world, rank, local rank, local size). The rendezvous is MASTER_ADDR:MASTER_PORT."""
    world_var, rank_var, local_rank_var, local_size_var = names
    world = parse_int(env, world_var, minimum=1)
    rank = parse_int(env, rank_var)
    if rank >= world:
        raise ClusterError(f"{rank_var}={rank} is beyond the world size {world_var}={world}")
    return ClusterEnv(
        contract=contract,
        role="worker",
        world_size=world,
        rank=rank,
        local_rank=parse_int(env, local_rank_var) if env.get(local_rank_var) else rank,
        local_size=parse_int(env, local_size_var, minimum=1) if env.get(local_size_var) else world,
        master_addr=env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
        master_port=parse_port(env, "MASTER_PORT", default_port),
    )


def _torchrun(env: Mapping[str, str]) -> ClusterEnv:
    return _rank_variables(env, "torchrun", ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
                           DEFAULT_MASTER_PORT)


def mpi_default_port(env: Mapping[str, str]) -> int:
    """A port derived from the mpirun job id, so that concurrent mpirun jobs on one host do not collide.

    OpenMPI 4 exports ``OMPI_MCA_ess_base_jobid``; OpenMPI 5 (PRRTE) exports ``PMIX_NAMESPACE``. Every rank of one
    job sees the same value, hence the same port. ``MASTER_PORT`` overrides it.
    """
    job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_orte_hnp_uri")
    if not job:
        return DEFAULT_MASTER_PORT
    return _derived_port(job)


def _openmpi(env: Mapping[str, str]) -> ClusterEnv:
    return _rank_variables(env, "openmpi", ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                                            "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                           mpi_default_port(env))


def _derived_port(*parts: str) -> int:
    """A port every rank of one job derives alike, different between jobs (and SLURM steps) on the same nodes."""
    digest = int(hashlib.sha256("/".join(parts).encode()).hexdigest(), 16)
    return 20000 + digest % 20000


def _slurm(env: Mapping[str, str]) -> ClusterEnv:
    """``srun``: one task per process; the first node of the step hosts the rendezvous (task 0 runs there)."""
    from autopar.cluster.slurm import expand_nodelist, expand_tasks_per_node

    world = parse_int(env, "SLURM_NTASKS", minimum=1, what=" (srun's task count)")
    rank = parse_int(env, "SLURM_PROCID")
    if rank >= world:
        raise ClusterError(f"SLURM_PROCID={rank} is beyond the world size SLURM_NTASKS={world}")
    list_var = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    nodes = expand_nodelist(env.get(list_var) or "", list_var) if env.get(list_var) else None
    local_size = None
    tasks_var = "SLURM_STEP_TASKS_PER_NODE" if env.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    if env.get(tasks_var) and env.get("SLURM_NODEID"):
        counts = expand_tasks_per_node(env[tasks_var], tasks_var)
        node = parse_int(env, "SLURM_NODEID")
        if node >= len(counts):
            raise ClusterError(f"SLURM_NODEID={node} but {tasks_var}={env[tasks_var]!r} lists {len(counts)} nodes")
        local_size = counts[node]
    master = env.get("MASTER_ADDR") or (nodes[0] if nodes else None)
    if master is None:
        raise ClusterError("SLURM_JOB_NODELIST is not set and neither is MASTER_ADDR: no host for the rendezvous")
    return ClusterEnv(
        contract="slurm",
        role="worker",
        world_size=world,
        rank=rank,
        local_rank=parse_int(env, "SLURM_LOCALID") if env.get("SLURM_LOCALID") else None,
        local_size=local_size,
        master_addr=master,
        master_port=parse_port(env, "MASTER_PORT", _derived_port("slurm", env.get("SLURM_JOB_ID", ""),
                                                                 env.get("SLURM_STEP_ID", ""))),
    )


def _kubernetes_indexed(env: Mapping[str, str]) -> ClusterEnv:
    """A Kubernetes indexed Job (or a JobSet of one replicated job): one pod per rank, the pod's completion index
    as its rank; ``WORLD_SIZE`` and ``MASTER_ADDR`` (pod 0's stable name) come from the job's spec."""
    world = parse_int(env, "WORLD_SIZE", minimum=1, what=" (the number of pods)")
    rank = parse_int(env, "JOB_COMPLETION_INDEX")
    if rank >= world:
        raise ClusterError(f"JOB_COMPLETION_INDEX={rank} is beyond the world size WORLD_SIZE={world}")
    if not env.get("MASTER_ADDR"):
        raise ClusterError("a Kubernetes indexed Job needs MASTER_ADDR (pod 0's name, e.g. <job>-0.<service>)")
    return ClusterEnv(contract="kubernetes", role="worker", world_size=world, rank=rank, local_rank=0, local_size=1,
                      master_addr=env["MASTER_ADDR"], master_port=parse_port(env, "MASTER_PORT", DEFAULT_MASTER_PORT))


def _ranktable(env: Mapping[str, str]) -> ClusterEnv | None:
    from autopar.cluster.ranktable import rank_from_env  # parsed only when a table is configured

    found = rank_from_env(env)
    if found is None:
        return None
    table, rank = found
    return ClusterEnv(
        contract="ranktable",
        role="worker",
        world_size=table.world_size,
        rank=rank,
        local_rank=table.local_rank(rank),
        local_size=table.local_size(rank),
        master_addr=env.get("MASTER_ADDR") or table.master_addr,
        master_port=parse_port(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
    )


def detect_cluster_env(env: Mapping[str, str] | None = None) -> ClusterEnv:
    """Read the launch contract of this process (see the module docstring for the precedence)."""
    env = os.environ if env is None else env
    if env.get("MS_ROLE"):
        return _mindspore(env)
    if env.get("RANK_TABLE_FILE") or env.get("MINDSPORE_HCCL_CONFIG_PATH"):
        found = _ranktable(env)
        if found is not None:
            return found
    if env.get("RANK") is not None and env.get("WORLD_SIZE") is not None:
        return _torchrun(env)
    if env.get("OMPI_COMM_WORLD_RANK") is not None:
        return _openmpi(env)
    if env.get("SLURM_PROCID") is not None and env.get("SLURM_NTASKS") is not None:
        return _slurm(env)
    if env.get("JOB_COMPLETION_INDEX") is not None and env.get("WORLD_SIZE") is not None:
        return _kubernetes_indexed(env)
    return ClusterEnv(contract="standalone", role="worker", world_size=1, rank=0, local_rank=0, local_size=1)
