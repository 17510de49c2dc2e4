"""GRAPH_MODE: the training forward (network + loss) compiled with ``torch.compile``, as MindSpore compiles graphs --
where it pays.

Compilation happens on the first step and again when shapes change (e.g. a smaller last batch); both are announced
with their duration. Whether it pays depends on the device (:func:`compiles`): on a GPU fused kernels and fewer
launches are worth the compile; on this kind of CPU they are not -- the tutorial's ResNet-50 took 169 s to compile
with a cold cache and the compiled step ran ~5 % *slower* than eager (issue 32's measurement; ``bench/dp_throughput.py
--graph-mode``). So GRAPH_MODE on a CPU runs eagerly and says so in one line; ``AUTOPAR_COMPILE=1`` compiles anyway,
``AUTOPAR_COMPILE=0`` never. The gradient engines' hooks stay outside what is compiled: they run as in eager mode.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

import torch


def compiles(device: torch.device) -> bool:
    """Does GRAPH_MODE compile on ``device``? ``AUTOPAR_COMPILE`` (1/0) decides if set, else: accelerators yes,
    CPU no."""
    import os

    choice = os.environ.get("AUTOPAR_COMPILE", "").strip().lower()
    if choice in ("1", "true", "yes", "on"):
        return True
    if choice in ("0", "false", "no", "off"):
        return False
    return device.type != "cpu"


def compile_forward(forward_loss: Callable[[list], torch.Tensor]) -> Callable[[list], torch.Tensor]:
    compiled = torch.compile(forward_loss)
    seen: set[tuple] = set()

    def run(inputs: list) -> torch.Tensor:
        key = tuple(tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor))
        if key in seen:
            return compiled(inputs)
        from autopar.comm import management

        rank0 = management.get_rank() == 0 if management.is_initialized() else True
        if rank0:
            print(f"autopar: GRAPH_MODE: compiling the network for inputs {list(key)} (torch.compile) ...",
                  file=sys.stderr, flush=True)
        start = time.perf_counter()
        out = compiled(inputs)
        seen.add(key)
        if rank0:
            print(f"autopar: GRAPH_MODE: compiled in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        return out
    return run
