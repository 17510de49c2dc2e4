"""Cluster files: a JSON description of a machine you may not have, read with one-line errors.

A cluster file names the device (peak FLOP/s per dtype, memory, memory bandwidth, the measured matmul ceiling, SMs),
the devices per node, the link inside a node (NVLink/NVSwitch, PCIe) and the network between nodes (NICs per node,
each NIC's bandwidth, latency). Every figure may carry its source under ``"sources"`` (JSON has no comments), keyed by
the field's dotted path. Presets live in ``planner/machines/*.json``.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from importlib import resources
from pathlib import Path

from autopar.errors import ConfigError, user_stacklevel
from autopar.planner.cluster.spec import ClusterSpec, Link
from autopar.planner.machine import MachineModel, available_memory, cache_path

PRESET_PACKAGE, PRESET_DIR = "autopar.planner", "machines"


_REQUIRED = {
    "device.name": str, "device.flops": dict, "device.matmul_efficiency": float, "device.memory_bytes": float,
    "device.memory_bandwidth": float, "devices_per_node": int,
    "intra_node.bandwidth": float, "intra_node.latency": float, "intra_node.efficiency": float,
    "inter_node.nics_per_node": int, "inter_node.nic_bandwidth": float, "inter_node.latency": float,
    "inter_node.efficiency": float,
}


_FREE = {"name", "description", "sources"}  # free-form: names, prose, each constant's source
# fields newer than the first files, or that may be left out: absent means the default (``nodes``: as many as a job
# needs -- the file then describes a node type and its network, not one cluster)
_OPTIONAL = {"device.attention_efficiency": float, "device.sms": int, "device.matmul_efficiency_fp8": float,
             "device.attention_efficiency_flash2": float, "nodes": int}


def _has(data: dict, dotted: str) -> bool:
    try:
        _get(data, dotted, "")
    except ConfigError:
        return False
    return True


def _leaves(data: dict, prefix: str = ""):
    """The dotted names of a cluster file's fields (the free-form ones and ``device.flops``' dtypes not entered)."""
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name not in _FREE and name != "device.flops":
            yield from _leaves(value, name + ".")
        else:
            yield name


def _get(data: dict, dotted: str, where: str):
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"{where}: missing field {dotted!r}")
        node = node[part]
    return node


def _field(data: dict, dotted: str, kind: type, where: str):
    value = _get(data, dotted, where)
    if kind is str:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: field {dotted!r} must be a non-empty string, got {value!r}")
        return value
    if kind is dict:
        if not isinstance(value, dict) or not value:
            raise ConfigError(f"{where}: field {dotted!r} must map dtypes to FLOP/s, got {value!r}")
        for k, v in value.items():
            _positive(v, f"{dotted}.{k}", where)
        return {k: float(v) for k, v in value.items()}
    _positive(value, dotted, where)
    if kind is int and (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"{where}: field {dotted!r} must be a whole number, got {value!r}")
    return int(value) if kind is int else float(value)


def _positive(value, dotted: str, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{where}: field {dotted!r} must be a positive number, got {value!r}")


def parse_cluster(data: dict, where: str = "machine file", preset: bool = False) -> ClusterSpec:
    """Validate a cluster description (one-line error naming the first bad field). A preset (``preset``) or a file
    without ``nodes`` is a node type: a job gets as many nodes as it needs; a file's ``nodes`` bounds the job."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    v = {k: _field(data, k, t, where) for k, t in _REQUIRED.items()}
    optional = {k: _field(data, k, t, where) for k, t in _OPTIONAL.items() if _has(data, k)}
    for k in ("device.attention_efficiency", "device.matmul_efficiency_fp8", "device.attention_efficiency_flash2"):
        if optional.get(k, 0) > 1:
            raise ConfigError(f"{where}: field {k!r} is a fraction of peak and must be <= 1, got {optional[k]}")
    unknown = sorted(set(_leaves(data)) - set(_REQUIRED) - set(_OPTIONAL) - _FREE)
    if unknown:  # a file written for another version (a field since dropped) still loads; what it says is not used
        warnings.warn(f"autopar: {where}: field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                      f"{'are' if len(unknown) > 1 else 'is'} not known to this version and ignored (known: "
                      f"{', '.join([*_REQUIRED, *_OPTIONAL])}, name, description, sources)", stacklevel=user_stacklevel())
    for k in ("device.matmul_efficiency", "intra_node.efficiency", "inter_node.efficiency"):
        if v[k] > 1:
            raise ConfigError(f"{where}: field {k!r} is a fraction of peak and must be <= 1, got {v[k]}")
    return ClusterSpec(
        name=str(data.get("name") or Path(where).stem), device_name=v["device.name"], flops=v["device.flops"],
        matmul_efficiency=v["device.matmul_efficiency"], memory=v["device.memory_bytes"],
        memory_bandwidth=v["device.memory_bandwidth"], devices_per_node=v["devices_per_node"], nodes=optional.get("nodes", 1),
        intra=Link(v["intra_node.bandwidth"], v["intra_node.latency"], v["intra_node.efficiency"]),
        nics_per_node=v["inter_node.nics_per_node"],
        inter=Link(v["inter_node.nic_bandwidth"], v["inter_node.latency"], v["inter_node.efficiency"]),
        description=str(data.get("description", "")), sources=data.get("sources"),
        attention_efficiency=optional.get("device.attention_efficiency"), sms=optional.get("device.sms"),
        matmul_efficiency_fp8=optional.get("device.matmul_efficiency_fp8"), scalable=preset or "nodes" not in optional,
        attention_efficiency_flash2=optional.get("device.attention_efficiency_flash2"))


def presets() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(PRESET_PACKAGE).joinpath(PRESET_DIR).iterdir()
                  if p.name.endswith(".json"))


def load_cluster(name_or_path: str) -> ClusterSpec:
    """A preset by name (``a100-ib``, ``h100-ib`` ...) or a JSON file of the same form."""
    path = Path(name_or_path)
    if name_or_path.endswith(".json") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"machine file {name_or_path} does not exist")
        text, where = path.read_text(), str(path)
    elif name_or_path in presets():
        text = resources.files(PRESET_PACKAGE).joinpath(PRESET_DIR, name_or_path + ".json").read_text()
        where = f"preset {name_or_path}"
    else:
        raise ConfigError(f"unknown machine {name_or_path!r}: give a JSON file or one of {', '.join(presets())}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg} at line {e.lineno})") from None
    return parse_cluster(data, where, preset=where.startswith("preset "))


def dry_run_machine(n: int) -> MachineModel:
    """The machine a dry run plans for (nothing can be measured on fake tensors): the cluster
    ``AUTOPAR_DRYRUN_MACHINE`` names (a preset such as ``h100-ib``, or a cluster JSON file), else this host's
    calibration where one is cached for the ``gloo`` backend, else the documented default constants."""
    name = os.environ.get("AUTOPAR_DRYRUN_MACHINE")
    if name:
        return load_cluster(name).group_machine(n, 1, os.environ.get("AUTOPAR_DRYRUN_DTYPE", "fp32"))
    warnings.warn("autopar: AUTO_PARALLEL planned for this host (its cached calibration, else default constants; "
                  "its memory shared by the local ranks): give --dry-run-machine for the cluster's", stacklevel=2)
    path = cache_path("gloo", n)
    model = MachineModel.from_json(path.read_text()) if path.exists() else MachineModel(device_num=n)
    model.memory_per_device = available_memory()
    return model
