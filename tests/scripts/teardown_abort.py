"""Worker: a job that finishes cleanly and then aborts while its process tears down, as torch's C++ teardown now and
then does ("terminate called without an active exception", SIGABRT). argv: [MODE]

- (none): an autopar script; the abort comes from an atexit handler registered before init(), which runs after
  autopar's end-of-process report;
- "early": an autopar script whose rank 1 aborts before its script ends (a real failure);
- "plain": a torchrun-style script that never imports autopar; the abort comes after every atexit handler, while
  the interpreter clears ``__main__`` (an object's finalizer);
- "plain-fail": the same, after its rank 1 raised (the abort must not hide that failure).
"""
import atexit
import os
import sys

import torch

mode = sys.argv[1] if len(sys.argv) > 1 else ""


class _AbortAtTeardown:
    def __del__(self):
        os.abort()


if mode.startswith("plain"):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"RANK {dist.get_rank()} SUM {total.item():.0f}", flush=True)
    rank = dist.get_rank()
    dist.destroy_process_group()
    _bomb = _AbortAtTeardown()
    if mode == "plain-fail" and rank == 1:
        raise RuntimeError("rank 1 fails after its all-reduce")
    sys.exit(0)

from autopar.communication import get_rank, init  # noqa: E402 - the plain modes never import autopar

if mode != "early":
    atexit.register(os.abort)  # runs after autopar's end-of-process report: the teardown abort
init()
total = torch.ones(1)
torch.distributed.all_reduce(total)
print(f"RANK {get_rank()} SUM {total.item():.0f}", flush=True)
if mode == "early" and get_rank() == 1:
    os.abort()
