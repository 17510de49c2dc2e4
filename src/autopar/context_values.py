"""Checks of single context values: memory sizes, MindSpore's ``comm_fusion`` dict, and the warning for keys that
are accepted but not acted on (no option is silently ignored). Leaf module: plain values in, ConfigError out."""
from __future__ import annotations

import warnings
from typing import Any

from autopar.errors import ConfigError, user_stacklevel


def memory_bytes(value: Any, key: str) -> float | None:
    """Accept 8e9, "8GB", "512MB", "1.5GiB" (MindSpore writes "1024GB")."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
        return float(value)
    text = str(value).strip().upper().replace(" ", "")
    units = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "TB": 2**40, "GB": 2**30, "MB": 2**20,
             "KB": 2**10, "B": 1}
    for unit, scale in units.items():
        if text.endswith(unit):
            try:
                return memory_bytes(float(text[: -len(unit)]) * scale, key)
            except ValueError:
                break
    raise ConfigError(f"{key}={value!r} is not a memory size (e.g. 8e9, '8GB', '512MB')")


# Keys autopar accepts (tutorial scripts pass them) but does not act on yet. A value that asks for something --
# not the default -- is warned about once: no option is silently ignored.
_NEUTRAL = {"strategy_ckpt_config": (None, {}),
            "enable_alltoall": (None, False), "auto_pipeline": (None, False), "pipeline_result_broadcast": (None, False)}
warned: set[str] = set()


def warn_not_applied(key: str, value: Any, why: str = "training runs as if it were not given") -> None:
    if key in warned or value in _NEUTRAL.get(key, (None,)):
        return
    warned.add(key)
    name = key.split(".")[0]
    warnings.warn(f"autopar: set_auto_parallel_context({name}={value if isinstance(value, str) else repr(value)}) "
                  f"is accepted but not applied yet: {why}", stacklevel=user_stacklevel())


_FUSION_OPS = ("allreduce", "allgather", "reducescatter")
_FUSION_MODES = ("auto", "size", "index")


def check_comm_fusion(value: Any) -> dict:
    """MindSpore's ``comm_fusion``: ``{"openstate": bool, "allreduce" | "allgather" | "reducescatter": {"mode":
    "auto" | "size" | "index", "config": None | MB | [indices]}}``. What acts: see :func:`autopar.context.allreduce_bucket_mb`;
    everything else is warned about once."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"comm_fusion must be a dict such as {{'allreduce': {{'mode': 'size', 'config': 32}}}}, "
                          f"got {value!r}")
    unknown = [k for k in value if k not in _FUSION_OPS + ("openstate",)]
    if unknown:
        raise ConfigError(f"comm_fusion: unknown key(s) {unknown}; expected 'openstate', {', '.join(_FUSION_OPS)}")
    if not isinstance(value.get("openstate", True), bool):
        raise ConfigError(f"comm_fusion: openstate must be True or False, got {value['openstate']!r}")
    for op in _FUSION_OPS:
        if op not in value:
            continue
        entry = value[op]
        if not isinstance(entry, dict) or entry.get("mode", "auto") not in _FUSION_MODES:
            raise ConfigError(f"comm_fusion[{op!r}] must be {{'mode': 'auto' | 'size' | 'index', 'config': ...}}, "
                              f"got {entry!r}")
        mode, config = entry.get("mode", "auto"), entry.get("config")
        if mode == "auto" and config is not None:
            raise ConfigError(f"comm_fusion[{op!r}]: mode 'auto' takes config None, got {config!r}")
        if mode == "size" and (isinstance(config, bool) or not isinstance(config, (int, float)) or config <= 0):
            raise ConfigError(f"comm_fusion[{op!r}]: mode 'size' takes config = the fusion size in MB (a positive "
                              f"number), got {config!r}")
        if mode == "index":
            if op != "allreduce":
                raise ConfigError(f"comm_fusion[{op!r}]: mode 'index' exists for 'allreduce' only (MindSpore)")
            if not isinstance(config, (list, tuple)) or not all(isinstance(i, int) for i in config):
                raise ConfigError(f"comm_fusion['allreduce']: mode 'index' takes config = a list of parameter "
                                  f"indices, got {config!r}")
            warn_not_applied("comm_fusion.index", "{'allreduce': {'mode': 'index', ...}}",
                              "gradients are fused by size; use {'allreduce': {'mode': 'size', 'config': MB}}")
        if op != "allreduce" and mode != "auto":
            warn_not_applied(f"comm_fusion.{op}", f"{{{op!r}: ...}}",
                              "optimizer sharding's all-gathers and reduce-scatters are bucketed by FSDP2, per module")
    return dict(value)
