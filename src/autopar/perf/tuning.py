"""Speed defaults applied by ``prepare`` -- each measured on its own (``bench/levers.py``) before becoming one.

Every lever can be switched through the environment, so that a user (or the benchmark) can turn it off and see
what it was worth. None changes results beyond float tolerance.

- ``AUTOPAR_FUSED_OPTIMIZER`` (default 1): torch optimizers that implement a fused kernel (SGD/Momentum, Adam,
  AdamW, Adagrad) and were built without an explicit ``foreach``/``fused`` choice run it -- one kernel for all
  parameters instead of ~160 small updates (ResNet-50 on this CPU: optimizer step 26 -> 17 ms). The multi-tensor
  ``foreach`` path, torch's own CUDA default, was *slower* on the CPU (30 ms) and is not used there.
- ``AUTOPAR_SMALL_CONV`` (default 1): on the CPU, convolutions whose output has at most 4 positions run as the
  matrix multiply they are (:mod:`autopar.perf.small_conv`); oneDNN is slow there, above all backward. The
  tutorial's ResNet-50 on 32x32 images: a training step 0.475 -> 0.284 s on one thread (1.67x).
- ``AUTOPAR_MALLOC`` (default 1): with glibc, a network training on the CPU keeps its freed heap memory instead
  of handing it back to the kernel every step, large blocks included (:func:`tune_allocator`). Whether glibc trims
  depends on the allocation history; fed by the tutorial's dataset pipeline, every ResNet-50 step re-faulted ~73 MB
  (18,600 minor page faults, 43 ms of kernel time on a 0.28 s step) -- the "framework" share of a step in
  ``bench/``. ``AUTOPAR_MALLOC=lean`` does the opposite, for a job whose memory is tight (a ZeRO-3 network bigger
  than a rank): every block of 1 MiB or more is a mapping of its own, handed back to the kernel when freed, so a
  rank's resident set is what its tensors hold. glibc's own thresholds keep 8-32 MiB blocks (a layer's weight
  gradients, the collectives' buffers) in a heap the per-layer gathers fragment: a 1 GiB GPT's ZeRO-3 step on 2
  ranks peaked at 3,232 MiB RSS with them, 2,496 MiB lean (the dry run's tensors: 1,720 MiB above the
  interpreter's 534), at 1.30x the step time (page faults) -- ``bench/results/sharded_init_malloc.json``.
- ``AUTOPAR_BUCKET_MB`` (default 25, DDP's): DATA_PARALLEL's gradient bucket size.
- ``AUTOPAR_SHARED_MEMORY`` (default 1): DATA_PARALLEL ranks that all run on one CPU host keep their gradients in
  shared memory and sum them there (:mod:`autopar.parallel.grads.buckets`) instead of through gloo's loopback TCP.
  ResNet-50's 90 MB of gradients on 2 ranks: all-reduce CPU per rank 51 -> 23 ms (``bench/allreduce_floor.py``);
  the tutorial's job 1.11x, 1.00x and 1.10x the images/s of the same job on gloo in three runs of
  ``bench/dp_throughput.py --ablate shared_memory`` (medians of 3 interleaved rounds on a 2-core VM whose speed drifts).
- ``AUTOPAR_CHANNELS_LAST`` (default 0): convolutional networks and their 4-D inputs in channels-last memory
  format. Measured no gain on this CPU (-2..+2 %, noise), so it is opt-in; it is the layout cuDNN's tensor
  cores prefer, so try it on a GPU with ``amp_level``.

Measured and kept as they were already: gradients as views of the all-reduce buckets (no copy, less memory),
no per-forward buffer broadcast (MindSpore's BatchNorm statistics stay per rank), ``OMP_NUM_THREADS`` = cores /
local workers (the launcher), a background prefetch thread (the dataset).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from autopar.context import env_flag

_FUSABLE = tuple(c for c in (getattr(torch.optim, n, None) for n in ("SGD", "Adam", "AdamW", "Adagrad")) if c)


@dataclass(frozen=True)
class Tuning:
    fused_optimizer: bool
    bucket_mb: float
    channels_last: bool
    small_conv: bool
    malloc: bool | str  # True: keep freed memory (the default), False: glibc's own thresholds, "lean": hand it back
    shared_memory: bool


def _malloc_setting() -> bool | str:
    raw = (os.environ.get("AUTOPAR_MALLOC") or "").strip().lower()
    return "lean" if raw == "lean" else env_flag("AUTOPAR_MALLOC", True)


def current() -> Tuning:
    return Tuning(
        fused_optimizer=env_flag("AUTOPAR_FUSED_OPTIMIZER", True),
        bucket_mb=float(os.environ.get("AUTOPAR_BUCKET_MB") or 25.0),
        channels_last=env_flag("AUTOPAR_CHANNELS_LAST", False),
        small_conv=env_flag("AUTOPAR_SMALL_CONV", True),
        malloc=_malloc_setting(),
        shared_memory=env_flag("AUTOPAR_SHARED_MEMORY", True),
    )


def is_convolutional(network: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Conv2d) for m in network.modules())


def tune_network(network: torch.nn.Module) -> bool:
    """Apply the network-side levers; True when the inputs should be made channels-last too."""
    tuning = current()
    if tuning.small_conv and any(p.device.type == "cpu" for p in network.parameters()):
        from autopar.perf import small_conv

        small_conv.install(network)
    if tuning.channels_last and is_convolutional(network):
        network.to(memory_format=torch.channels_last)
        return True
    return False


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more on 64-bit hosts
_LEAN_MMAP_THRESHOLD = 1 << 20  # AUTOPAR_MALLOC=lean: a block this large or larger is a mapping of its own
_TRIM_THRESHOLD = 1 << 30
_allocator_tuned = False


def tune_allocator(network: torch.nn.Module, device: torch.device | None = None) -> bool:
    """Keep freed CPU memory in glibc's heap across training steps; True if the allocator was (or already is) tuned.

    A step frees and re-allocates the same activations. glibc serves blocks above a moving threshold with fresh
    ``mmap`` calls and trims a free heap top above 128 KB; either way the next step touches new pages and pays a
    page fault per 4 KB. A heap trimmed only above 1 GiB, and no ``mmap`` at all (glibc caps its threshold at 32 MB:
    every larger block -- a 64 MB weight's gradient, made anew each step -- was still mapped and faulted in), end
    that; the price is that memory freed after the peak stays with the process, which a training loop reuses every
    step anyway. The wide MLP of ``bench/auto_vs_hand.py`` on 4 ranks: data parallel's step 567-576 -> 353-452 ms,
    its CPU per rank 272-280 -> 175-180 ms (the 64 MB gradients' page faults). ``AUTOPAR_MALLOC=lean``: a fixed
    1 MiB mapping threshold instead (see the module docstring). Process-wide and idempotent; a no-op
    off glibc, for networks on the GPU (``device``: the job's, where the network is still on the meta device), for
    a network built on the meta device (unless ``lean``: its memory is what matters), or with ``AUTOPAR_MALLOC=0``.
    """
    global _allocator_tuned
    if _allocator_tuned:
        return True
    # the job's device: a network built on the meta device is materialised there later
    on_cpu = device.type == "cpu" if device is not None else any(p.device.type == "cpu" for p in network.parameters())
    malloc = current().malloc
    if not malloc or not on_cpu:
        return False
    if malloc is True and any(p.is_meta for p in network.parameters()):
        # built on the meta device because its memory is tight: freed memory is not kept (a 1 GiB GPT's ZeRO-3 step
        # on 2 ranks, meta-built: 3,222 MiB RSS with glibc's own thresholds, 4,585 with freed memory kept in one run)
        return False
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    if malloc == "lean":  # a fixed threshold: glibc no longer raises it as mapped blocks are freed
        _allocator_tuned = bool(mallopt(_M_MMAP_THRESHOLD, _LEAN_MMAP_THRESHOLD))
    else:
        _allocator_tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
            mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)) and bool(mallopt(_M_MMAP_MAX, 0))
    return _allocator_tuned


def tune_optimizer(optimizer: torch.optim.Optimizer | None) -> bool:
    """Switch a fusable optimizer to its fused kernel where the user left the choice open; True if switched."""
    if optimizer is None or not current().fused_optimizer or not isinstance(optimizer, _FUSABLE):
        return False
    groups = optimizer.param_groups
    if any(g.get("foreach") is not None or g.get("fused") or g.get("differentiable") for g in groups):
        return False
    from autopar.common.replaced import resolve

    params = [resolve(p) for g in groups for p in g["params"]]  # what it will step: a sharded replacement, maybe
    if not params or any(not p.is_floating_point() or p.is_sparse for p in params):
        return False
    if len({(p.device.type, p.dtype) for p in params}) != 1 or params[0].device.type not in ("cpu", "cuda"):
        return False
    if any(type(p) is not torch.nn.Parameter and type(p) is not torch.Tensor for p in params):
        return False  # DTensor parameters (layout modes): the fused kernels take plain tensors
    for g in groups:
        g["fused"] = True
    optimizer.defaults["fused"] = True
    if hasattr(optimizer, "_step_supports_amp_scaling"):
        optimizer._step_supports_amp_scaling = True  # as torch's own constructor sets it for fused=True
    return True


def channels_last_inputs(items: list) -> list:
    return [t.contiguous(memory_format=torch.channels_last)
            if isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point() else t for t in items]
