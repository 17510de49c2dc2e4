"""GRAPH_MODE: the training forward (network + loss) compiled with ``torch.compile``, as MindSpore compiles graphs.

The compiled function calls the DDP-wrapped network when data parallel, so TorchDynamo's DDP optimizer splits the
graph at bucket boundaries and the gradient all-reduce still overlaps the backward. Compilation happens on the
first step and again when shapes change (e.g. a smaller last batch); both are announced with their duration, since
on a CPU a ResNet-50 takes about a minute to compile and the user should know why the first step is slow.
``bench/graph_mode.py`` measures whether it pays: on this 2-core CPU it did not, so PYNATIVE stays the default.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

import torch


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
