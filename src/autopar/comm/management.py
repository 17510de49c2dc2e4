"""Cluster membership and communication groups: ``init``, ``get_rank``, ``create_group``, ``release``.

``init()`` reads the launch contract (see :mod:`autopar.cluster.env`), rendezvouses, and builds the default
torch.distributed process group: gloo on CPU, NCCL (plus gloo for CPU tensors) when CUDA is used, each rank bound
to the GPU of its local rank. A process started with no contract becomes a world of one with a real process group,
so the same code (collectives, data parallel, DTensor) runs unchanged on 1 process and on N.
"""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar import context as _context
from autopar.cluster.env import comm_timeout, detect_cluster_env
from autopar.cluster.protocol import seconds
from autopar.errors import ClusterError, CommError


class GlobalComm:
    """MindSpore's names for the world group (``GlobalComm.WORLD_COMM_GROUP``)."""

    WORLD_COMM_GROUP = "world_group"
    BACKEND = None
    INITED = False


WORLD_GROUP_NAMES = ("world_group", "hccl_world_group", "nccl_world_group", "mccl_world_group")


@dataclass
class _State:
    initialized: bool = False
    contract: str = ""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_size: int = 1
    backend: str = "gloo"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    watchdog: object | None = None
    groups: dict[str, tuple[dist.ProcessGroup | None, tuple[int, ...]]] = field(default_factory=dict)


_state = _State()


# What a collective that lost its peer raises: autopar's CommError, or torch's own (gloo through torch.distributed,
# DDP): a DistError, or a RuntimeError naming the broken connection.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Read error", "Write error",
              "gloo/transport")


def _echoes_a_peer(exc_type, exc) -> bool:
    """Did this exception probably come from another rank's death (not this rank's own fault)?"""
    if issubclass(exc_type, CommError):
        return "timed out" not in str(exc).lower()  # a timeout is this rank's own verdict
    return issubclass(exc_type, RuntimeError) and (
        issubclass(exc_type, dist.DistError) or any(mark in str(exc) for mark in _PEER_LOST))


def _torch_collective(exc: BaseException) -> tuple[str, str] | None:
    """(what, where) when ``exc`` came out of one of torch's own collectives (``torch.distributed.all_reduce``,
    DDP's gradient all-reduce, ...): the operation and the script's line that called it. None for anything else."""
    import traceback

    from autopar.errors import AutoparError

    if not isinstance(exc, RuntimeError) or isinstance(exc, AutoparError):  # autopar's own collectives say it all
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    torch_dir = os.path.dirname(torch.__file__)
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    c10d = [f for f in frames if f.filename.endswith(os.path.join("distributed", "distributed_c10d.py"))]
    text = str(exc)
    if c10d:
        what = f"torch.distributed.{c10d[0].name}"
    elif isinstance(exc, dist.DistError) or "gloo" in text or "NCCL" in text:
        what = "a collective of torch's" + (" (DDP's gradient all-reduce, in backward)"
                                            if any(f.name == "backward" for f in frames) else "")
    else:
        return None
    user = [f for f in frames if not f.filename.startswith((torch_dir, ours))]
    where = f" at {os.path.basename(user[-1].filename)}:{user[-1].lineno}" if user else ""
    return what, where


def _collective_line(exc: BaseException, what: str, where: str, ended: dict[int, str]) -> str:
    """The one line for a failed collective of torch's: the operation, the script's line, and the rank that left."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    first = first.split("] ", 1)[1] if first.startswith("[/") and "] " in first else first  # gloo's source path
    first = first.split(". This is typically", 1)[0]  # gloo's advice, the same for every fault
    left = ", ".join(f"rank {r} ({status})" for r, status in sorted(ended.items()))
    if left:
        return f"{what}{where} failed: {left} had already left the job -- the ranks did not call the same collectives"
    if "timed out" in first.lower() or "timeout" in first.lower():
        from autopar.cluster.env import comm_timeout as _timeout

        return (f"{what}{where} timed out after {_timeout():.0f} s (AUTOPAR_COMM_TIMEOUT): another rank never "
                f"joined it (stuck, or calling other collectives)")
    return f"{what}{where} failed: {first}"


def _on_uncaught(exc_type, exc) -> str | None:
    """Before an uncaught exception is printed: a failure that only echoes another rank's death waits for the
    scheduler's verdict and stops quietly as "aborted" (one line, EXIT_ABORTED) instead of a gloo traceback; a
    collective of torch's own that failed otherwise (a peer that left early, a timeout) becomes one line naming
    the operation, the script's line and the rank that left; any crash is recorded for the scheduler's report."""
    watchdog = _state.watchdog
    collective = _torch_collective(exc) if _state.world_size > 1 else None
    ended: dict[int, str] = {}
    if watchdog is not None:
        if _echoes_a_peer(exc_type, exc):
            import time

            from autopar.cluster.env import heartbeat_timeout
            from autopar.cluster.worker import CLEAN_END

            # the scheduler's verdict (another rank died: abort) or the peer's own report (it ended: it left)
            deadline = time.monotonic() + heartbeat_timeout() + 2.0
            while time.monotonic() < deadline and watchdog.thread.is_alive():
                if watchdog.abort_reason is not None:
                    watchdog.stop_as_secondary(watchdog.abort_reason)
                if collective is not None:
                    ended = watchdog.ended_ranks(_state.world_size)
                    if CLEAN_END in ended.values():  # a peer that failed is followed by the scheduler's abort
                        break
                time.sleep(0.1)
        line = _collective_line(exc, *collective, ended) if collective is not None else None
        watchdog.failure = line or f"{exc_type.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return line
    return _collective_line(exc, *collective, {}) if collective is not None else None


def _install_excepthook() -> None:
    """One-line errors for autopar's own exceptions (:func:`autopar.errors.install_excepthook`), with this rank
    in front of them, and every crash recorded for the scheduler's report."""
    from autopar import errors

    errors.on_uncaught(_on_uncaught)
    errors.set_error_prefix(lambda: f"[rank {_state.rank}] " if _state.world_size > 1 else "")
    errors.install_excepthook()


def _choose_backend(name: str | None) -> tuple[str, bool]:
    """Return (torch backend string, uses_cuda)."""
    target = _context.run_context().device_target
    requested = (name or "").lower() or None
    if requested in ("hccl",):
        requested = None  # Ascend scripts call init("hccl"): run them on what this machine has
    if requested not in (None, "nccl", "gloo", "mccl"):
        raise CommError(f"unknown communication backend {name!r}: use 'nccl' (GPU) or 'gloo' (CPU)")
    want_cuda = requested == "nccl" or target == "GPU" or (target is None and requested is None and torch.cuda.is_available())
    if requested in ("gloo", "mccl") or target == "CPU":
        want_cuda = False
    if want_cuda:
        if not torch.cuda.is_available():
            raise CommError("NCCL / device_target='GPU' requested but CUDA is not available on this machine")
        return "cpu:gloo,cuda:nccl", True
    return "gloo", False


def init(backend_name: str | None = None) -> None:
    """Join the cluster described by the environment and build the default process group.

    In a MindSpore scheduler process (``MS_ROLE=MS_SCHED``) this never returns: the process hosts the rendezvous,
    watches the workers and exits with the job's status.
    """
    if _state.initialized:
        return
    _install_excepthook()
    if dist.is_initialized():  # the script built torch's world itself (torchrun style): join it, form no second
        _adopt_torch_world()
        return
    cenv = detect_cluster_env()
    if cenv.role == "scheduler":
        from autopar.cluster.scheduler import run_scheduler

        run_scheduler(cenv)
    from autopar.cluster.rendezvous import form_cluster

    member = form_cluster(cenv)
    _state.watchdog = member.watchdog
    backend, cuda = _choose_backend(backend_name)
    device = torch.device("cpu")
    if cuda:
        index = _context.run_context().device_id
        index = member.local_rank % torch.cuda.device_count() if index is None else index
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    try:
        dist.init_process_group(
            backend,
            init_method=member.init_method,
            store=member.store,
            rank=member.rank,
            world_size=member.world_size,
            timeout=seconds(comm_timeout()),
            device_id=device if cuda else None,
        )
    except Exception as exc:
        from autopar.cluster.protocol import first_line

        raise ClusterError(f"building the process group failed ({backend}): {first_line(exc)}") from None
    _install_excepthook()  # outside torch's "[rankN]: " wrapper, which init_process_group just put around it
    atexit.register(_destroy_at_exit)
    _state.initialized = True
    _state.contract = member.contract
    _state.rank = member.rank
    _state.world_size = member.world_size
    _state.local_rank = member.local_rank
    _state.local_size = member.local_size
    _state.backend = "nccl" if cuda else "gloo"
    _state.device = device
    _state.groups = {}
    GlobalComm.INITED = True
    GlobalComm.BACKEND = _state.backend
    _context.check_world(member.world_size, member.rank)


def _dry_run_on_gpus() -> bool:
    """In a dry run's fake world: does the script run its GPU path (``--dry-run-device cuda``, and not
    ``device_target="CPU"``)? A GPU script dry-run on the CPU says in one line how to simulate its GPUs."""
    target = _context.run_context().device_target
    if os.environ.get("AUTOPAR_DRYRUN_DEVICE") == "cuda":
        return target != "CPU"
    if target == "GPU":
        raise CommError("device_target='GPU' in a dry run on the CPU: simulate the GPUs with autopar launch "
                        "--dry-run --dry-run-device cuda")
    return False


def _adopt_torch_world() -> None:
    """``init()`` after ``torch.distributed.init_process_group``: take that world as it is (rank, size, backend;
    the local rank from torchrun's ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend()).lower()
    cuda = "nccl" in backend or (backend == "fake" and _dry_run_on_gpus())
    _state.initialized = True
    _state.contract = "torch"
    _state.rank, _state.world_size = rank, world
    _state.local_rank = int(os.environ.get("LOCAL_RANK", rank))
    _state.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    _state.backend = "nccl" if cuda else "gloo"
    if cuda and backend == "fake" and not os.environ.get("AUTOPAR_DRYRUN_SCRIPT_INIT"):
        index = _context.run_context().device_id  # the dry run's world stands for the one init() would form
        torch.cuda.set_device(_state.local_rank % torch.cuda.device_count() if index is None else index)
    _state.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    _state.groups = {}
    GlobalComm.INITED = True
    GlobalComm.BACKEND = _state.backend
    _context.check_world(world, rank)


def _destroy_at_exit() -> None:
    """Tear the process group down while the interpreter is alive: left to C++ static destructors at exit, gloo's
    threads can abort the process (SIGABRT) and turn a clean exit code into a crash."""
    if _state.initialized and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        _state.initialized = False


def is_initialized() -> bool:
    return _state.initialized


def _require_init() -> None:
    if not _state.initialized:
        raise ClusterError("autopar.communication.init() has not been called in this process")


def release() -> None:
    """Destroy the process group (MindSpore's ``release``); ``init()`` may be called again afterwards."""
    if not _state.initialized:
        return
    for pg, _ in _state.groups.values():
        if pg is not None:
            dist.destroy_process_group(pg)
    dist.destroy_process_group()
    _state.initialized = False
    _state.groups = {}
    GlobalComm.INITED = False


def device() -> torch.device:
    """The device this rank computes on (its GPU under NCCL, else CPU)."""
    return _state.device


def any_rank(flag: bool) -> bool:
    """Collective (every rank calls it): is ``flag`` set on any rank? Ranks agree before they part ways -- a rank
    that failed alone stops the others instead of leaving them in the next collective. ``flag`` itself outside a
    job of several ranks."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return bool(flag)
    t = torch.tensor([int(bool(flag))], dtype=torch.int32, device=device())  # (NCCL: not a CPU tensor)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def backend() -> str:
    return _state.backend


def contract() -> str:
    return _state.contract


def _resolve(group: str | dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, tuple[int, ...] | None]:
    """(process group or None for WORLD, member world ranks or None for everyone)."""
    _require_init()
    if group is None or isinstance(group, dist.ProcessGroup):
        return group, None if group is None else tuple(dist.get_process_group_ranks(group))
    if group in WORLD_GROUP_NAMES:
        return None, None
    if group not in _state.groups:
        raise CommError(f"unknown communication group {group!r}; create it with create_group(name, ranks)")
    return _state.groups[group]


def get_process_group(group: str | dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """The torch ProcessGroup behind a group name (None = the world), for PyTorch-native calls."""
    pg, ranks = _resolve(group)
    if ranks is not None and _state.rank not in ranks:
        raise CommError(f"rank {_state.rank} is not a member of group {group!r} (members: {list(ranks)})")
    return pg


def get_rank(group: str | dist.ProcessGroup | None = None) -> int:
    """This process's rank in the world, or in ``group``."""
    pg, ranks = _resolve(group)
    if ranks is None:
        return _state.rank
    if _state.rank not in ranks:
        raise CommError(f"rank {_state.rank} is not a member of group {group!r} (members: {list(ranks)})")
    return ranks.index(_state.rank)


def get_group_size(group: str | dist.ProcessGroup | None = None) -> int:
    _, ranks = _resolve(group)
    return _state.world_size if ranks is None else len(ranks)


def get_local_rank(group: str | dist.ProcessGroup | None = None) -> int:
    """Index of this process among the job's processes on its host."""
    _resolve(group)
    return _state.local_rank


def get_local_size(group: str | dist.ProcessGroup | None = None) -> int:
    _resolve(group)
    return _state.local_size


def create_group(group: str, rank_ids: list[int] | tuple[int, ...]) -> None:
    """Create a named communication group of world ranks (called by the group's members, as in MindSpore)."""
    _require_init()
    ranks = tuple(int(r) for r in rank_ids)
    if not ranks:
        raise CommError(f"create_group({group!r}): the rank list is empty")
    if len(set(ranks)) != len(ranks):
        raise CommError(f"create_group({group!r}): duplicate ranks in {list(ranks)}")
    bad = [r for r in ranks if not 0 <= r < _state.world_size]
    if bad:
        raise CommError(f"create_group({group!r}): ranks {bad} are outside the world of {_state.world_size}")
    if group in WORLD_GROUP_NAMES or group in _state.groups:
        raise CommError(f"communication group {group!r} already exists")
    if _state.rank not in ranks:
        raise CommError(f"create_group({group!r}) must be called by its members; rank {_state.rank} is not in {list(ranks)}")
    pg = dist.new_group(list(ranks), use_local_synchronization=True)
    _state.groups[group] = (pg, ranks)


def destroy_group(group: str) -> None:
    _require_init()
    if group not in _state.groups:
        raise CommError(f"unknown communication group {group!r}")
    pg, _ = _state.groups.pop(group)
    if pg is not None:
        dist.destroy_process_group(pg)


def get_world_rank_from_group_rank(group: str, group_rank_id: int) -> int:
    _, ranks = _resolve(group)
    ranks = ranks or tuple(range(_state.world_size))
    if not 0 <= group_rank_id < len(ranks):
        raise CommError(f"group rank {group_rank_id} is outside group {group!r} of size {len(ranks)}")
    return ranks[group_rank_id]


def get_group_rank_from_world_rank(world_rank_id: int, group: str) -> int:
    _, ranks = _resolve(group)
    ranks = ranks or tuple(range(_state.world_size))
    if world_rank_id not in ranks:
        raise CommError(f"world rank {world_rank_id} is not in group {group!r}")
    return ranks.index(world_rank_id)
