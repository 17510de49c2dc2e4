"""What autopar's ``view`` handler costs on DTensor's hot path (``parallel/tensor/handlers._view``: registered for
every DTensor ``view`` / ``_unsafe_view`` so that a sequence split flattened over a 2-axis mesh can be unflattened;
every other view falls back to DTensor's own path through a second dispatch).

One process, a 1-rank gloo mesh, a DTensor split on its first dimension: per ``view`` call, the median over rounds of
the time with the handler installed and without it, interleaved, and their ratio; and the same for one layout-mode
step of a small MLP-with-heads workload (views into heads and back), to put the per-call figure in a step's scale.

    python bench/dtensor_view.py [--rounds 7] [--calls 2000] [--out results/dtensor_view.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from autopar.parallel.tensor import handlers


def _calls(x: DTensor, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        x.view(4, 8, 4, 16)
    return (time.perf_counter() - start) / n


def _block(x: DTensor, w: DTensor, n: int) -> float:
    """A layer's worth of views: project, split into heads, merge back (as an attention block does)."""
    start = time.perf_counter()
    for _ in range(n):
        h = (x @ w).view(4, 8, 4, 16).transpose(1, 2).contiguous().view(4, 4, 8, 16)
        h.transpose(1, 2).contiguous().view(4, 8, 64)
    return (time.perf_counter() - start) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    x = distribute_tensor(torch.randn(4, 8, 64), mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(64, 64), mesh, [Shard(1)])
    table = DTensor._op_dispatcher._custom_op_handlers
    ops = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
    times: dict[str, list[float]] = {k: [] for k in ("view_with", "view_without", "block_with", "block_without")}
    for _ in range(args.rounds):
        for installed in (True, False):
            for op in ops:
                if installed:
                    handlers.install(op, handlers._view)
                else:
                    table.pop(op, None)
            tag = "with" if installed else "without"
            times[f"view_{tag}"].append(_calls(x, args.calls))
            times[f"block_{tag}"].append(_block(x, w, args.calls // 10))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"rounds": args.rounds, "calls": args.calls, "torch": torch.__version__,
              "view_us": {"with_handler": round(med["view_with"] * 1e6, 2),
                          "without": round(med["view_without"] * 1e6, 2),
                          "ratio": round(med["view_with"] / med["view_without"], 3)},
              "block_us": {"with_handler": round(med["block_with"] * 1e6, 1),
                           "without": round(med["block_without"] * 1e6, 1),
                           "ratio": round(med["block_with"] / med["block_without"], 3)}}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
