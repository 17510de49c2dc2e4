"""A cluster as data: its device, its nodes, the link inside a node and the network between them.

What each figure means and where it comes from is in the cluster files (``files.py``, presets in
``planner/machines/*.json``, every figure with its source); what a collective costs on it is ``collectives.py``'s,
what a GEMM reaches on its device ``kernels.py``'s.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from autopar.errors import ConfigError
from autopar.planner.cluster.collectives import OVERLAP_SLOWDOWN, collective_seconds, placement
from autopar.planner.cluster.kernels import GroupMachine, tile_and_wave_efficiency
from autopar.planner.machine import MachineModel


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, one direction, per device (intra) or per NIC (inter)
    latency: float  # seconds per hop
    efficiency: float  # achieved fraction of the line rate (bus bandwidth / bandwidth)

    @property
    def effective(self) -> float:
        return self.bandwidth * self.efficiency


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
    # the fraction of peak FlashAttention-2's kernel reaches, where the device has a faster one (Hopper's
    # FlashAttention-3 / cuDNN kernels: ``attention_efficiency``); None: the same
    attention_efficiency_flash2: float | None = None
    # collectives run by NCCL (its protocols' latencies); False for this host's calibrated figures
    nccl: bool = True
    # a node type rather than one cluster (the presets, a cluster file without ``nodes``): a job of more devices than
    # ``nodes`` holds gets as many nodes of the type as it needs
    scalable: bool = False

    def for_devices(self, devices: int) -> "ClusterSpec":
        """This cluster with room for ``devices`` -- more nodes of its type where it is a node type
        (``scalable``); a cluster of fixed size that is too small says so in one line."""
        if devices <= self.devices:
            return self
        nodes = math.ceil(devices / self.devices_per_node)
        if not self.scalable:
            raise ConfigError(f"{devices} devices need {nodes} nodes of {self.devices_per_node}, but machine "
                              f"{self.name!r} has nodes = {self.nodes} ({self.devices} devices): raise its nodes, "
                              f"or leave the field out to plan as many nodes of its type as a job needs")
        return dataclasses.replace(self, nodes=nodes)

    def attention_rate(self, kernel: str = "fused") -> float:
        """The fraction of peak a fused attention kernel reaches: ``flash2`` FlashAttention-2's, else the device's
        best (``--attention``)."""
        best = self.attention_efficiency or self.matmul_efficiency
        return (self.attention_efficiency_flash2 or best) if kernel == "flash2" else best

    def gemm_ceiling(self, dtype: str) -> float:
        return self.matmul_efficiency_fp8 if dtype == "fp8" and self.matmul_efficiency_fp8 else self.matmul_efficiency

    def gemm_efficiency(self, batch: int, m: int, n: int) -> float:
        """The fraction of the measured matmul ceiling a GEMM of ``batch`` x ``m`` x ``n`` outputs reaches
        (kernels.py)."""
        return tile_and_wave_efficiency(self.sms, batch, m, n)

    @property
    def overlap_slowdown(self) -> float:
        """How much slower compute runs beside a collective it hides (``collectives.OVERLAP_SLOWDOWN``, measured on
        NCCL's kernels); none on this host's calibrated figures, whose measured steps hold their own."""
        return OVERLAP_SLOWDOWN if self.nccl else 0.0

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

    # -- collectives (collectives.py) -------------------------------------------------------------------------
    def placement(self, size: int, stride: int) -> tuple[int, int]:
        """(members per node, nodes) of a group of ``size`` devices ``stride`` ranks apart (ranks fill nodes)."""
        return placement(self, size, stride)

    def collective(self, kind: str, nbytes: float, size: int, stride: int = 1) -> tuple[float, str]:
        """Seconds and algorithm ("ring" / "tree") of a collective on a group placed with ``stride``."""
        return collective_seconds(self, kind, nbytes, size, stride)

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

    def group_machine(self, size: int, stride: int, dtype: str, attention_kernel: str = "fused") -> MachineModel:
        """The flat machine model the operator-level search uses for one group (e.g. the tensor-parallel group)."""
        return GroupMachine(self, size, stride, dtype, attention_kernel)


