"""Worker: DTensor's redistribution of a parameter's gradient (R -> R, its gradient a partial sum: the backward's
all-reduce) timed by the operator timer as a job plans, on every rank at once. argv: OUT_JSON (rank appended).

Where ranks outnumber the cores, the time kept is the least rank's (the one that arrived last): every rank must hold
that same number, and the reduction that makes it (``_least_rank``) must give the least of the ranks' values."""
import json
import sys

import torch
from torch.distributed.tensor import Partial, Replicate

import autopar
from autopar.comm import management
from autopar.comm.topology import world_mesh
from autopar.communication import get_group_size, get_rank, init
from autopar.planner.op_timer import OpTimer

autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
init()
rank, n = get_rank(), get_group_size()
timer = OpTimer(torch.device("cpu"), None, together=True, local_ranks=management.get_local_size())
k = world_mesh().ndim  # (4 ranks: a 2 x 2 mesh)
seconds = timer.reshard((Replicate(),) * k, (Replicate(),) * k, (512,), 4, grad=(Partial(),) * k)
json.dump({"oversubscribed": timer.oversubscribed, "seconds": seconds, "threads": torch.get_num_threads(),
           "least_of_ranks": timer._least_rank((1.0 + rank, 10.0 - rank))},
          open(f"{sys.argv[1]}.{rank}", "w"))
