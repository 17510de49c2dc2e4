"""Clusters as data: a JSON description of a machine you may not have, and hierarchical collective costs on it.

A cluster file names the device (peak FLOP/s per dtype, memory, memory bandwidth, the fraction of peak large matmuls
reach), the devices per node, the link inside a node (NVLink/NVSwitch, PCIe) and the network between nodes (NICs
per node, each NIC's bandwidth, latency). Every figure may carry its source under ``"sources"`` (JSON has no
comments), keyed by the field's dotted path. Presets live in ``machines/*.json`` beside this module.

Collectives are costed as NCCL runs them (nccl-tests' definition of bus bandwidth): a collective of ``S`` bytes on
``n`` devices moves ``f(n) * S`` through each device's slowest link, ``f`` = 2(n-1)/n for all-reduce and (n-1)/n
for all-gather / reduce-scatter / all-to-all. Inside one node the bus bandwidth is the intra-node link's; across
``k`` nodes with ``m`` group members per node, the ring crosses the network on the members' own NICs (rail
aligned), so the bus bandwidth is ``min(intra, m * nic)``. Latency: a ring pays a hop per member and step; a tree
(all-reduce across nodes) pays ``2 log2(k)`` network hops but moves each byte twice -- the cheaper one is used, as
NCCL's tuner picks between them.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from autopar.errors import ConfigError, user_stacklevel
from autopar.planner.machine import RING, MachineModel, available_memory, cache_path

PRESET_DIR = "machines"


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, one direction, per device (intra) or per NIC (inter)
    latency: float  # seconds per hop
    efficiency: float  # achieved fraction of the line rate (bus bandwidth / bandwidth)

    @property
    def effective(self) -> float:
        return self.bandwidth * self.efficiency


# NCCL's ring latencies per protocol (src/graph/tuning.cc, github.com/NVIDIA/nccl): baseLat, once a collective
# (Ring: LL128 14.0 us, Simple 8.4 us) and hwLat per hop for Simple (Ring: NVLink 3.4 us, network 14.0 us); LL128's
# hops are the presets' link latencies (hwLat Ring LL128: NVLink 1.9 us, network 4.0 us)
NCCL_BASE_LATENCY = {"LL128": 14.0e-6, "Simple": 8.4e-6}
NCCL_SIMPLE_HOP = {"intra": 3.4e-6, "inter": 14.0e-6}

# threadblock tiles (rows x columns of the output) of cuBLAS's / CUTLASS's bf16 tensor-core GEMMs on A100 and H100
# (CUTLASS's default 128x256 / 256x128 and 128x128 tile configurations, media/docs/efficient_gemm.md)
GEMM_TILES = ((256, 128), (128, 256), (128, 128))


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    device_name: str
    flops: dict  # dtype -> peak FLOP/s (dense)
    matmul_efficiency: float  # fraction of peak reached by large matmuls
    memory: float  # bytes per device
    memory_bandwidth: float  # bytes/s per device
    devices_per_node: int
    nodes: int  # how many nodes the cluster has
    intra: Link
    nics_per_node: int
    inter: Link
    description: str = ""
    sources: dict | None = None
    # fraction of peak a fused causal attention kernel reaches, forward and backward together (None: a file written
    # before the field -- taken as matmul_efficiency)
    attention_efficiency: float | None = None
    # streaming multiprocessors (None: every GEMM at matmul_efficiency, whatever its shape)
    sms: int | None = None
    # the measured matmul ceiling of a dtype whose GEMMs reach another fraction of its peak (fp8), else
    # matmul_efficiency
    matmul_efficiency_fp8: float | None = None
    # collectives run by NCCL (its protocols' latencies); False for this host's calibrated figures
    nccl: bool = True

    def gemm_ceiling(self, dtype: str) -> float:
        return self.matmul_efficiency_fp8 if dtype == "fp8" and self.matmul_efficiency_fp8 else self.matmul_efficiency

    def gemm_efficiency(self, batch: int, m: int, n: int) -> float:
        """The fraction of the measured matmul ceiling a GEMM of ``batch`` x ``m`` x ``n`` outputs reaches: tile and
        wave quantization (NVIDIA's Matrix Multiplication Background User's Guide, docs.nvidia.com/deeplearning/
        performance/dl-performance-matrix-multiplication): the output is cut into threadblock tiles, one SM a
        tile, so a shape pays for its last partial tile and its last partial wave of ``sms`` tiles. The kernel
        takes whichever of cuBLAS's large tensor-core tiles wastes least, each taken at the ceiling's rate."""
        if not self.sms:
            return 1.0
        best = 0.0
        for tm, tn in GEMM_TILES:
            tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
            best = max(best, batch * m * n / (math.ceil(tiles / self.sms) * self.sms * tm * tn))
        return best

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def nic_per_device(self) -> float:
        """Network bytes/s one device can use when every device of its node sends at once (rail aligned)."""
        return self.inter.effective * self.nics_per_node / self.devices_per_node

    def peak(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise ConfigError(f"machine {self.name!r} gives no FLOP/s for dtype {dtype!r} (has: "
                              f"{', '.join(sorted(self.flops))})")
        return float(self.flops[dtype])

    # -- collectives ------------------------------------------------------------------------------------------
    def placement(self, size: int, stride: int) -> tuple[int, int]:
        """(members per node, nodes) of a group of ``size`` devices ``stride`` ranks apart (ranks fill nodes)."""
        if size <= 1:
            return 1, 1
        per_node = max(1, min(size, self.devices_per_node // stride)) if stride < self.devices_per_node else 1
        return per_node, math.ceil(size / per_node)

    def collective(self, kind: str, nbytes: float, size: int, stride: int = 1) -> tuple[float, str]:
        """Seconds and algorithm ("ring" / "tree") of a collective on a group placed with ``stride``.

        A ring runs NCCL's faster protocol for its size (NCCL's tuner): LL128, whose hops are the links' own
        latencies and whose lines carry 120 bytes of data in 128, or Simple, full bandwidth for longer hops and
        base latency -- so a small collective on thousands of ranks pays thousands of hops, and a large one its
        bytes. A cluster described by a calibration (this host, not NCCL) pays its links' figures alone."""
        if size <= 1 or nbytes <= 0:
            return 0.0, "none"
        m, k = self.placement(size, stride)
        factor = RING[kind](size)
        steps = 2 if kind == "all_reduce" else 1
        bus = self.intra.effective if k == 1 else min(self.intra.effective, m * self.nic_per_device)
        inter_hops, intra_hops = (0, size - 1) if k == 1 else (k, size - k)
        ring = steps * (inter_hops * self.inter.latency + intra_hops * self.intra.latency) + factor * nbytes / bus
        if self.nccl:
            ll128 = NCCL_BASE_LATENCY["LL128"] + ring + factor * nbytes / bus * (128 / 120 - 1)
            simple = NCCL_BASE_LATENCY["Simple"] + steps * (inter_hops * NCCL_SIMPLE_HOP["inter"] + intra_hops * max(
                NCCL_SIMPLE_HOP["intra"], self.intra.latency)) + factor * nbytes / bus
            ring = min(ll128, simple)
        if kind != "all_reduce" or k == 1:
            return ring, "ring"
        tree = 2 * (math.ceil(math.log2(k)) * self.inter.latency + (m - 1) * self.intra.latency) + 2 * nbytes / bus
        return (tree, "tree") if tree < ring else (ring, "ring")

    @classmethod
    def from_machine_model(cls, model: MachineModel, devices: int) -> "ClusterSpec":
        """This host as a one-node cluster, from its calibration (the default when no machine file is given)."""
        alpha, beta = model.collectives["all_reduce"]
        link = Link(1.0 / beta, alpha / max(1, 2 * (devices - 1)), 1.0)
        memory = model.memory_per_device or 2.0**30
        return cls(name="this host", device_name="CPU worker", flops={"fp32": model.flops["matmul"]}, nccl=False,
                   matmul_efficiency=1.0, memory=memory, memory_bandwidth=model.memory_bandwidth,
                   devices_per_node=devices, nodes=1, intra=link, nics_per_node=1, inter=link,
                   description=model.source)

    def group_machine(self, size: int, stride: int, dtype: str) -> MachineModel:
        """The flat machine model the operator-level search uses for one group (e.g. the tensor-parallel group)."""
        return GroupMachine(self, size, stride, dtype)


class GroupMachine(MachineModel):
    """A :class:`MachineModel` whose collectives are those of one placed group of a :class:`ClusterSpec`."""

    def __init__(self, spec: ClusterSpec, size: int, stride: int, dtype: str):
        rate = spec.peak(dtype) * spec.gemm_ceiling(dtype)
        # fp8 runs the projections' GEMMs only (Transformer Engine): attention stays at the bf16 rate
        held = "bf16" if dtype == "fp8" else dtype
        attention = spec.peak(held) * (spec.attention_efficiency or spec.matmul_efficiency)
        super().__init__(device_num=size, flops={"matmul": rate, "conv": rate, "other": rate, "attention": attention},
                         backend="nccl", source=f"{spec.name} ({spec.device_name}, {dtype})",
                         memory_bandwidth=spec.memory_bandwidth, memory_per_device=spec.memory)
        self.spec, self.stride = spec, stride
        self.matmul_rate = rate

    def gemm_seconds(self, batch: int, m: int, n: int, k: int) -> float:
        """Seconds of one ``batch`` x (``m`` x ``k``) @ (``k`` x ``n``) GEMM at its shape's rate."""
        return 2.0 * batch * m * n * k / (self.matmul_rate * self.spec.gemm_efficiency(batch, m, n))

    def collective(self, kind: str, nbytes: float, n: int) -> float:
        return self.spec.collective(kind, nbytes, n, self.stride)[0]


# ------------------------------------------------------------------------------------------------ reading files
_REQUIRED = {
    "device.name": str, "device.flops": dict, "device.matmul_efficiency": float, "device.memory_bytes": float,
    "device.memory_bandwidth": float, "devices_per_node": int, "nodes": int,
    "intra_node.bandwidth": float, "intra_node.latency": float, "intra_node.efficiency": float,
    "inter_node.nics_per_node": int, "inter_node.nic_bandwidth": float, "inter_node.latency": float,
    "inter_node.efficiency": float,
}


_FREE = {"name", "description", "sources"}  # free-form: names, prose, each constant's source
_OPTIONAL = {"device.attention_efficiency": float, "device.sms": int, "device.matmul_efficiency_fp8": float}  # fields newer than the first files: absent means the default


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


def parse_cluster(data: dict, where: str = "machine file") -> ClusterSpec:
    """Validate a cluster description (one-line error naming the first bad field)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    v = {k: _field(data, k, t, where) for k, t in _REQUIRED.items()}
    optional = {k: _field(data, k, t, where) for k, t in _OPTIONAL.items() if _has(data, k)}
    for k in ("device.attention_efficiency", "device.matmul_efficiency_fp8"):
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
        memory_bandwidth=v["device.memory_bandwidth"], devices_per_node=v["devices_per_node"], nodes=v["nodes"],
        intra=Link(v["intra_node.bandwidth"], v["intra_node.latency"], v["intra_node.efficiency"]),
        nics_per_node=v["inter_node.nics_per_node"],
        inter=Link(v["inter_node.nic_bandwidth"], v["inter_node.latency"], v["inter_node.efficiency"]),
        description=str(data.get("description", "")), sources=data.get("sources"),
        attention_efficiency=optional.get("device.attention_efficiency"), sms=optional.get("device.sms"),
        matmul_efficiency_fp8=optional.get("device.matmul_efficiency_fp8"))


def presets() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(__package__).joinpath(PRESET_DIR).iterdir()
                  if p.name.endswith(".json"))


def load_cluster(name_or_path: str) -> ClusterSpec:
    """A preset by name (``a100-ib``, ``h100-ib`` ...) or a JSON file of the same form."""
    path = Path(name_or_path)
    if name_or_path.endswith(".json") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"machine file {name_or_path} does not exist")
        text, where = path.read_text(), str(path)
    elif name_or_path in presets():
        text = resources.files(__package__).joinpath(PRESET_DIR, name_or_path + ".json").read_text()
        where = f"preset {name_or_path}"
    else:
        raise ConfigError(f"unknown machine {name_or_path!r}: give a JSON file or one of {', '.join(presets())}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg} at line {e.lineno})") from None
    return parse_cluster(data, where)


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
