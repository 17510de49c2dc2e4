"""Worker: a job that finishes cleanly and then aborts while its process tears down (an atexit handler registered
before init() runs after autopar's end report, as torch's C++ teardown does) -- or, with argv[1] == "early", aborts
before its script ends. argv: [early]"""
import atexit
import os
import sys

import torch

from autopar.communication import get_rank, init

early = len(sys.argv) > 1 and sys.argv[1] == "early"
if not early:
    atexit.register(os.abort)  # runs after autopar's end-of-process report: the teardown abort
init()
total = torch.ones(1)
torch.distributed.all_reduce(total)
print(f"RANK {get_rank()} SUM {total.item():.0f}", flush=True)
if early and get_rank() == 1:
    os.abort()
