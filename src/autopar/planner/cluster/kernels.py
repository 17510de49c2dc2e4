"""Compute on a cluster's device: what a GEMM of a given shape reaches, and the rates the operator-level search
prices a tensor group's operators at (matmuls, fused attention, fp8 projections, memory-bound work)."""
from __future__ import annotations

import math

from autopar.planner.costs import gemm_dims
from autopar.planner.machine import MachineModel

# threadblock tiles (rows x columns of the output) of cuBLAS's / CUTLASS's bf16 tensor-core GEMMs on A100 and H100
# (CUTLASS's default 128x256 / 256x128 and 128x128 tile configurations, media/docs/efficient_gemm.md)
GEMM_TILES = ((256, 128), (128, 256), (128, 128))


# The cross entropy over the logits, as the stacks the planner predicts run it -- the logits upcast to fp32, a
# log-softmax, the target's log-probability picked (torchtitan's ``cross_entropy(pred.float(), ...)``, Megatron-Core's
# vocabulary-parallel cross entropy on ``logits.float()``) -- is memory-bound: bytes moved per logit, counted pass by
# pass from PyTorch's kernels (aten/src/ATen/native/cuda/SoftMax.cu's ``cunn_SoftMaxForward`` reads its input for the
# maximum, again for the sum of exponentials and again to write the output): forward, the upcast (read 2, write 4)
# and the log-softmax (3 reads and a write of 4) = 22; backward, the dense gradient of the pick (write 4), the
# log-softmax's backward (its output and the incoming gradient read, the gradient's row sum read again, the result
# written: 16) and the cast back (read 4, write 2) = 26
LOSS_TRAFFIC_BYTES_PER_LOGIT = {"forward": 22.0, "backward": 26.0}
# A fused cross entropy (flash-attn's ``CrossEntropyLoss(inplace_backward=True)``, Liger's): one kernel reads the bf16
# logits twice (the row's maximum and sum, then the gradient) and writes the gradient over them
FUSED_LOSS_TRAFFIC_BYTES_PER_LOGIT = {"forward": 2.0, "backward": 4.0}


def tile_and_wave_efficiency(sms: int | None, batch: int, m: int, n: int) -> float:
    """The fraction of the measured matmul ceiling a GEMM of ``batch`` x ``m`` x ``n`` outputs reaches: tile and
    wave quantization (NVIDIA's Matrix Multiplication Background User's Guide, docs.nvidia.com/deeplearning/
    performance/dl-performance-matrix-multiplication): the output is cut into threadblock tiles, one SM a tile, so a
    shape pays for its last partial tile and its last partial wave of ``sms`` tiles. The kernel takes whichever of
    cuBLAS's large tensor-core tiles wastes least, each taken at the ceiling's rate; without an SM count, 1."""
    if not sms:
        return 1.0
    best = 0.0
    for tm, tn in GEMM_TILES:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        best = max(best, batch * m * n / (math.ceil(tiles / sms) * sms * tm * tn))
    return best



class GroupMachine(MachineModel):
    """A :class:`MachineModel` whose collectives are those of one placed group of a cluster (``spec``, a
    :class:`~autopar.planner.cluster.spec.ClusterSpec`, which makes these)."""

    def __init__(self, spec, size: int, stride: int, dtype: str, attention_kernel: str = "fused"):
        rate = spec.peak(dtype) * spec.gemm_ceiling(dtype)
        # fp8 runs the projections' GEMMs only (Transformer Engine): attention stays at the bf16 rate
        held = "bf16" if dtype == "fp8" else dtype
        attention = spec.peak(held) * spec.attention_rate(attention_kernel)
        super().__init__(device_num=size, flops={"matmul": rate, "conv": rate, "other": rate, "attention": attention},
                         backend="nccl", source=f"{spec.name} ({spec.device_name}, {dtype})",
                         memory_bandwidth=spec.memory_bandwidth, memory_per_device=spec.memory)
        self.spec, self.stride = spec, stride
        self.matmul_rate = rate  # a projection's (a Linear's): fp8 under fp8
        self.held_rate = spec.peak(held) * spec.gemm_ceiling(held)  # any other GEMM's (attention's batched matmuls)

    def gemm_seconds(self, batch: int, m: int, n: int, k: int, projection: bool = True) -> float:
        """Seconds of one ``batch`` x (``m`` x ``k``) @ (``k`` x ``n``) GEMM at its shape's rate; ``projection``: a
        Linear's (fp8 under fp8), else a batched matmul of the attention (bf16 under fp8, as Transformer Engine)."""
        rate = self.matmul_rate if projection else self.held_rate
        return 2.0 * batch * m * n * k / (rate * self.spec.gemm_efficiency(batch, m, n))

    def collective(self, kind: str, nbytes: float, n: int) -> float:
        return self.spec.collective(kind, nbytes, n, self.stride)[0]


# fp8 projections first cast their bf16 operands to fp8 -- memory-bound kernels the GEMMs wait for. Bytes moved per
# element of each operand of a Linear (its input M x K, its weight K x N, the gradient of its output M x N), (forward,
# backward), by scaling recipe:
# - "tensorwise" / "rowwise": torchao's float8 training (torchtitan's; tensorwise is also Transformer Engine's
#   per-tensor current scaling, an amax pass then a cast-transpose), counted kernel by kernel in torchao's own
#   roofline (torchao/testing/training/roofline_utils.py, ``get_tensor_memory_traffic_ovhd_s``, unfused): tensorwise
#   reads an operand once for its absolute maximum and again to write it in fp8 row- and column-major (2 + 2 + 2x1);
#   rowwise writes a bf16 transpose first (scales per row of each layout), its weight casts spread over both passes;
# - "delayed": Transformer Engine's default (``DelayedScaling``, as Megatron-Core and NeMo run fp8): the scale comes
#   from the amax history, so one fused cast-transpose kernel reads bf16 once and writes fp8 twice (2 + 2x1); a
#   weight is cast once a step (``is_first_microbatch``), a micro-batch's share of it taken as nothing.
FP8_CAST_BYTES = {
    "delayed": {"input": (4.0, 0.0), "weight": (0.0, 0.0), "grad_output": (0.0, 4.0)},
    "tensorwise": {"input": (6.0, 0.0), "weight": (5.0, 3.0), "grad_output": (0.0, 6.0)},
    "rowwise": {"input": (5.0, 3.0), "weight": (3.0, 7.0), "grad_output": (0.0, 8.0)},
}
FP8_RECIPES = tuple(FP8_CAST_BYTES)
# Under sequence parallelism a column-split projection's input arrives split on the sequence and is gathered: the
# per-tensor recipes cast the slice and gather fp8 (TE's LayerNormLinear, torchao's Float8ColwiseParallel); rowwise
# gathers bf16 and casts the whole gathered input on every rank (torchao's README: "rowwise with bfloat16
# all-gather").
FP8_CASTS_BEFORE_GATHER = {"delayed": True, "tensorwise": True, "rowwise": False}


def fp8_cast_bytes(recipe: str, inputs: float, weights: float, grads: float) -> tuple[float, float]:
    """(forward + backward, forward) bytes the casts of one fp8 Linear move under ``recipe``, given the elements of
    its input, its weight and its output's gradient."""
    total = forward = 0.0
    for role, elements in (("input", inputs), ("weight", weights), ("grad_output", grads)):
        fwd, bwd = FP8_CAST_BYTES[recipe][role]
        forward += fwd * elements
        total += (fwd + bwd) * elements
    return total, forward


def fp8_cast_seconds(nodes, chosen, memory_bandwidth: float, t: int, sp: bool, recipe: str) -> tuple[float, float]:
    """(forward + backward, forward) seconds of the fp8 casts of ``nodes``' Linears (their chosen strategies in
    ``chosen``) on one device of a tensor group of ``t`` under ``recipe`` (:data:`FP8_CAST_BYTES`)."""
    total = forward = 0.0
    for node, c in zip(nodes, chosen):
        dims = gemm_dims(node, c.plan) if node.kind == "linear" else None
        if dims is None:
            continue
        b, m, n, k = dims
        inputs = b * m * k
        whole_k = k == node.shapes[1][-1]  # a column-split (or whole) projection: its input whole on the rank
        if sp and t > 1 and whole_k and FP8_CASTS_BEFORE_GATHER[recipe]:
            inputs /= t
        both, fwd = fp8_cast_bytes(recipe, inputs, k * n, b * m * n)
        total += both / memory_bandwidth
        forward += fwd / memory_bandwidth
    return total, forward
