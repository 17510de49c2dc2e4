"""Global run-time and parallel context: ``set_context``, ``set_auto_parallel_context``, ``set_ps_context``.

One leaf module holding plain state, so every layer can read it without import cycles. Names and values follow
MindSpore (``mindspore.context``); unknown keys are errors (a typo must not silently train the wrong way), and
keys that only make sense on MindSpore's own runtime are accepted and documented as having no effect.
"""
from __future__ import annotations

import contextlib
import copy
import os
import threading
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from autopar.context_values import check_comm_fusion, memory_bytes, warn_not_applied, warned  # noqa: F401
from autopar.errors import ConfigError, warn_once

GRAPH_MODE = 0
PYNATIVE_MODE = 1
DEFAULT_LOG_DIR = "autopar_logs"


def env_flag(name: str, default: bool) -> bool:
    """An on/off switch from the environment (``AUTOPAR_SHARED_MEMORY=0``): unset or empty is ``default``; 0, false,
    no and off (any case) are off; anything else is on. One reading for every switch autopar has."""
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off")


def log_dir() -> str:
    """Where this run writes its metrics and plans (the launcher sets ``AUTOPAR_LOG_DIR`` to its ``--log-dir``)."""
    return os.environ.get("AUTOPAR_LOG_DIR") or DEFAULT_LOG_DIR


class ParallelMode(str, Enum):
    """MindSpore's parallel modes; members compare equal to their lower-case string values."""

    STAND_ALONE = "stand_alone"
    DATA_PARALLEL = "data_parallel"
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"
    AUTO_PARALLEL = "auto_parallel"
    HYBRID_PARALLEL = "hybrid_parallel"

    def __str__(self) -> str:  # print as MindSpore does: the value
        return self.value

    @classmethod
    def parse(cls, value: Any) -> "ParallelMode":
        if isinstance(value, cls):
            return value
        text = str(value).strip().lower()
        for mode in cls:
            if text in (mode.value, mode.name.lower()):
                return mode
        valid = ", ".join(m.value for m in cls)
        raise ConfigError(f"unknown parallel_mode {value!r}; expected one of: {valid}")


SEARCH_MODES = ("dynamic_programming", "recursive_programming", "sharding_propagation")


@dataclass
class _RunContext:
    mode: int = PYNATIVE_MODE
    device_target: str | None = None  # None = CUDA if available, else CPU
    device_id: int | None = None
    max_device_memory: float | None = None  # bytes


@dataclass
class _AutoParallelContext:
    parallel_mode: ParallelMode = ParallelMode.STAND_ALONE
    gradients_mean: bool = False
    parameter_broadcast: bool = False
    device_num: int | None = None
    global_rank: int | None = None
    full_batch: bool = False
    dataset_strategy: Any = "data_parallel"
    strategy_ckpt_save_file: str | None = None
    strategy_ckpt_load_file: str | None = None
    search_mode: str = "dynamic_programming"
    max_device_memory: float | None = None  # bytes per device, for the AUTO_PARALLEL planner
    grad_accumulation_step: int = 1
    enable_parallel_optimizer: bool = False  # ZeRO on FSDP2 (parallel.optimizer_shard), data_parallel
    parallel_optimizer_config: dict = field(default_factory=dict)  # {"optimizer_level": "level1|level2|level3"}
    pipeline_stages: int = 1  # > 1: nn.PipelineCell runs on torch.distributed.pipelining (parallel.pipeline)
    pipeline_config: dict = field(default_factory=dict)  # {"pipeline_scheduler": "1f1b" | "gpipe"}
    optimizer_weight_shard_size: int = -1  # -1: all data-parallel ranks; s: hybrid, groups of s ranks
    loss_repeated_mean: bool = True
    gradient_fp32_sync: bool = True
    all_reduce_fusion_config: list = field(default_factory=list)
    comm_fusion: dict = field(default_factory=dict)  # {"allreduce": {"mode": "size", "config": 32}, ...}
    # context parallelism (dataset_strategy splitting the sequence): how attention meets the other ranks' tokens --
    # "all_gather" (keys and values gathered, Llama 3's form) or "ulysses" (all-to-all onto a split of the heads,
    # DeepSpeed-Ulysses; MindFormers' "ulysses_cp") or "ring" (ring attention, causal work balanced; MindFormers'
    # "colossalai_cp")
    context_parallel_algo: str = "all_gather"


@dataclass
class _PsContext:
    enable_ssl: bool = False


_run = _RunContext()
_auto = _AutoParallelContext()
_given: set[str] = set()  # the auto-parallel keys the user set (given_by_user)
_ps = _PsContext()

# MindSpore keys with no meaning here: accepted (tutorial scripts pass them), ignored.
_IGNORED_RUN_KEYS = {
    "save_graphs", "save_graphs_path", "enable_hccl", "enable_graph_kernel", "enable_reduce_precision",
    "variable_memory_max_size", "enable_profiling", "reserve_class_name_in_scope", "enable_auto_mixed_precision",
    "graph_kernel_flags", "jit_config", "memory_optimize_level", "pynative_synchronize", "runtime_num_threads",
    "enable_compile_cache", "compile_cache_path", "inter_op_parallel_num", "check_bprop", "max_call_depth",
}
_ASCEND_TUNING_KEYS = {"enable_task_sink", "enable_loop_sink", "enable_mem_reuse"}  # MindSpore r0.x: warned, ignored
_IGNORED_AUTO_KEYS = {"strategy_ckpt_config", "enable_alltoall", "auto_pipeline", "pipeline_result_broadcast"}
_KNOWN_PS_KEYS = {"enable_ssl", "client_password", "server_password", "config_file_path"}


def set_context(**kwargs: Any) -> None:
    """``mode`` (GRAPH_MODE compiles the network with torch.compile; PYNATIVE_MODE runs eagerly),
    ``device_target`` ("CPU" or "GPU"), ``device_id``, ``max_device_memory``."""
    for key, value in kwargs.items():
        if key == "mode":
            if value not in (GRAPH_MODE, PYNATIVE_MODE):
                raise ConfigError(f"mode must be GRAPH_MODE ({GRAPH_MODE}) or PYNATIVE_MODE ({PYNATIVE_MODE}), got {value!r}")
            _run.mode = value
        elif key == "device_target":
            target = str(value).upper() if value is not None else None
            if target in ("ASCEND", "DAVINCI"):
                raise ConfigError("device_target='Ascend' is not available in autopar: use 'CPU' (gloo) or 'GPU' (NCCL)")
            if target not in (None, "CPU", "GPU"):
                raise ConfigError(f"device_target must be 'CPU' or 'GPU', got {value!r}")
            _run.device_target = target
        elif key == "device_id":
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"device_id must be a non-negative integer, got {value!r}")
            _run.device_id = value
        elif key == "max_device_memory":
            _run.max_device_memory = memory_bytes(value, key)
        elif key in _IGNORED_RUN_KEYS:
            continue
        elif key in _ASCEND_TUNING_KEYS:
            warn_once(f"set_context.{key}", f"set_context({key}={value!r}) is accepted but not applied: it tunes "
                      f"MindSpore's Ascend execution")
        else:
            valid = ", ".join(sorted([f.name for f in fields(_RunContext)]))
            raise ConfigError(f"set_context got an unknown key {key!r}; valid keys: {valid}")


def get_context(key: str) -> Any:
    if key in {f.name for f in fields(_RunContext)}:
        return getattr(_run, key)
    raise ConfigError(f"get_context got an unknown key {key!r}")


def set_auto_parallel_context(**kwargs: Any) -> None:
    """Configure parallel training (call before building the network / Model), as in MindSpore."""
    valid = {f.name for f in fields(_AutoParallelContext)}
    _check_batch_split(kwargs)
    for key, value in kwargs.items():
        if key == "auto_parallel_search_mode":
            key = "search_mode"
        if key == "mirror_mean":  # MindSpore r0.x name of gradients_mean
            key = "gradients_mean"
        if key == "parallel_mode":
            value = ParallelMode.parse(value)
        elif key == "search_mode":
            if value not in SEARCH_MODES:
                raise ConfigError(f"unknown search_mode {value!r}; expected one of: {', '.join(SEARCH_MODES)}")
        elif key in _BOOL_KEYS:
            if not isinstance(value, bool):
                raise ConfigError(f"{key} must be True or False, got {value!r} ({type(value).__name__})")
        elif key in ("device_num", "global_rank") and value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "device_num" else 0):
                raise ConfigError(f"{key} must be a {'positive' if key == 'device_num' else 'non-negative'} integer, got {value!r}")
            if (known := _known_world()) is not None:
                check_world(*known, **{key: value})
        elif key == "grad_accumulation_step":
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"grad_accumulation_step must be a positive integer, got {value!r}")
        elif key == "max_device_memory":
            value = memory_bytes(value, key)
        elif key == "dataset_strategy":
            if not (value in ("data_parallel", "full_batch") or isinstance(value, (tuple, list))):
                raise ConfigError(f"dataset_strategy must be 'data_parallel', 'full_batch' or a tuple of splits, got {value!r}")
            if value == "full_batch":
                _auto.full_batch = True
        elif key in _IGNORED_AUTO_KEYS:
            warn_not_applied(key, value)
            continue
        elif key == "pipeline_stages" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"pipeline_stages must be a positive integer, got {value!r}")
        elif key in ("parallel_optimizer_config", "pipeline_config") and not isinstance(value, dict):
            raise ConfigError(f"{key} must be a dict, got {value!r}")
        elif key == "comm_fusion":
            value = check_comm_fusion(value)
        elif key == "context_parallel_algo":
            value = {"ulysses_cp": "ulysses", "colossalai_cp": "ring"}.get(value, value)
            if value not in ("all_gather", "ulysses", "ring"):
                raise ConfigError(f"context_parallel_algo must be 'all_gather', 'ulysses' ('ulysses_cp') or 'ring' "
                                  f"('colossalai_cp'), got {value!r}")
        elif key not in valid:
            raise ConfigError(
                f"set_auto_parallel_context got an unknown key {key!r}; valid keys: {', '.join(sorted(valid))}"
            )
        setattr(_auto, key, value)
        _given.add(key)
    if _auto.parallel_mode is not ParallelMode.STAND_ALONE:
        for listener in list(_mode_listeners):
            listener()


_BOOL_KEYS = ("gradients_mean", "parameter_broadcast", "full_batch", "enable_parallel_optimizer",
              "loss_repeated_mean", "gradient_fp32_sync")


def _check_batch_split(kwargs: dict) -> None:
    """``full_batch=True`` (every rank loads the whole batch) and a ``dataset_strategy`` tuple (each rank loads its
    slice) contradict each other, in one call or across calls (MindSpore refuses the pair as well)."""
    full = kwargs.get("full_batch", _auto.full_batch)
    strategy = kwargs.get("dataset_strategy", _auto.dataset_strategy)
    if full is True and isinstance(strategy, (tuple, list)):
        raise ConfigError(f"full_batch=True and dataset_strategy={strategy!r} contradict each other (the whole batch "
                          f"on every rank, or each rank its slice): set one of them")


def _known_world() -> tuple[int, int] | None:
    """(world size, rank) once the process group exists, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return None


def check_world(world_size: int, rank: int, device_num: int | None = None, global_rank: int | None = None) -> None:
    """``device_num`` / ``global_rank`` set by the script must match the job (called by ``init()`` once the world is
    known, and at set time after it): a different count would size layouts and averages for devices that do not
    exist."""
    device_num = _auto.device_num if device_num is None else device_num
    global_rank = _auto.global_rank if global_rank is None else global_rank
    if device_num is not None and device_num != world_size:
        raise ConfigError(f"device_num={device_num} but this job has {world_size} rank(s): set device_num to "
                          f"{world_size} or leave it out (it defaults to the job's size)")
    if global_rank is not None and global_rank != rank:
        raise ConfigError(f"global_rank={global_rank} but this process is rank {rank} of {world_size}: leave "
                          f"global_rank out (init() assigns it)")


def allreduce_bucket_mb() -> float | None:
    """The all-reduce bucket size that ``comm_fusion`` asks for, in MB (2**20 bytes), for the gradient reducers:

    - no ``comm_fusion``, no ``"allreduce"`` entry, or ``{"mode": "auto"}``: None -- the engine's default;
    - ``{"mode": "size", "config": s}``: ``float(s)``;
    - ``{"mode": "index", ...}``: None (fusion by parameter index is not honoured; warned when set);
    - ``"openstate": False``: 0.0 -- no fusion, each gradient travels on its own.
    """
    fusion = _auto.comm_fusion or {}
    if fusion.get("openstate", True) is False:
        return 0.0
    entry = fusion.get("allreduce") or {}
    if entry.get("mode") == "size":
        return float(entry["config"])
    return None


def set_device(device_target: str, device_id: int | None = None) -> None:
    """MindSpore 2.5+'s ``set_device("CPU")`` / ``set_device("GPU", 0)``: ``set_context(device_target=...,
    device_id=...)``."""
    set_context(device_target=device_target, device_id=device_id)


_mode_listeners: list = []
_reset_listeners: list = []


def on_reset(listener) -> None:
    """Call ``listener()`` when the parallel context is reset (a higher layer removes what it installed)."""
    if listener not in _reset_listeners:
        _reset_listeners.append(listener)


def on_parallel_mode(listener) -> None:
    """Call ``listener()`` whenever a parallel mode other than STAND_ALONE is set (a higher layer installs what
    that mode needs -- e.g. the hooks that parallelize a network on its first call -- without this module
    importing it)."""
    if listener not in _mode_listeners:
        _mode_listeners.append(listener)
    if _auto.parallel_mode is not ParallelMode.STAND_ALONE:
        listener()


def parallel_mode() -> ParallelMode:
    """The current mode, without copying the context (read on every module call by the first-call hook)."""
    return _auto.parallel_mode


class ScopedFlag:
    """A per-thread flag that is on inside ``with flag():`` blocks (nested blocks count)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @contextlib.contextmanager
    def __call__(self):
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth

    def on(self) -> bool:
        return getattr(self._local, "depth", 0) > 0


# Calls inside run as they are: no network parallelizes itself on its first call (autopar's own traces and pipeline
# schedules; a user's one-process reference inside a parallel job: ``with autopar.context.managed(): ref(x)``).
managed = ScopedFlag()
is_managed = managed.on

# Work autopar does on the side of the user's training -- timing an optimizer step at calibration, the planner's
# measurements, AUTO's measured round on copies of the network: its optimizer steps are not the user's (a dry run's
# measurement counts steps, and stopped the script after two of the calibration's).
side_work = ScopedFlag()
in_side_work = side_work.on


def get_auto_parallel_context(key: str) -> Any:
    if key == "auto_parallel_search_mode":
        key = "search_mode"
    if key == "mirror_mean":
        key = "gradients_mean"
    if key in {f.name for f in fields(_AutoParallelContext)}:
        value = getattr(_auto, key)
        if key in ("device_num", "global_rank") and value is None:
            return _communication_default(key)
        return value
    raise ConfigError(f"get_auto_parallel_context got an unknown key {key!r}")


def _communication_default(key: str) -> int:
    """device_num / global_rank default to the communication layer's values once init() ran (MindSpore does too)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() if key == "device_num" else dist.get_rank()
    return 1 if key == "device_num" else 0


def reset_auto_parallel_context() -> None:
    """Back to MindSpore's defaults (stand-alone); what a parallel mode installed process-wide (the first-call
    hooks) is removed. Networks parallelized before keep training as they were set up."""
    global _auto
    _auto = _AutoParallelContext()
    _given.clear()
    for listener in list(_reset_listeners):
        listener()


def given_by_user(key: str) -> bool:
    """Was ``key`` set by ``set_auto_parallel_context`` (since the last reset)? Where a default leaves a choice open
    (``context_parallel_algo``), AUTO_PARALLEL makes it; a value the user gave, even the default's, is kept."""
    return key in _given


def auto_parallel_context() -> _AutoParallelContext:
    """A snapshot of the parallel context, for the layers that act on it."""
    return copy.deepcopy(_auto)


def run_context() -> _RunContext:
    return copy.deepcopy(_run)


def set_ps_context(**kwargs: Any) -> None:
    """Accepted for MindSpore compatibility (the CPU tutorial calls ``set_ps_context(enable_ssl=False)``).

    ``enable_ssl=True`` is accepted but encrypts nothing, and says so once on stderr: the rendezvous admits only
    processes holding the job token (an HMAC, the token itself never crosses the wire), but the store's keys and
    all gloo/NCCL traffic travel in clear. See docs/reliability.md, "Security"."""
    for key, value in kwargs.items():
        if key not in _KNOWN_PS_KEYS:
            raise ConfigError(f"set_ps_context got an unknown key {key!r}; valid keys: {', '.join(sorted(_KNOWN_PS_KEYS))}")
        if key == "enable_ssl":
            if not isinstance(value, bool):
                raise ConfigError(f"enable_ssl must be True or False, got {value!r} ({type(value).__name__})")
            if value and not _ps.enable_ssl:
                import sys

                print("autopar: warning: enable_ssl=True is accepted but NOT applied: the job token keeps stray "
                      "processes out, yet rendezvous and gloo/NCCL traffic are unencrypted; run multi-host jobs on "
                      "a trusted network (docs/reliability.md, Security)", file=sys.stderr, flush=True)
            _ps.enable_ssl = bool(value)


def get_ps_context(key: str) -> Any:
    if key == "enable_ssl":
        return _ps.enable_ssl
    raise ConfigError(f"get_ps_context got an unknown key {key!r}")
