"""A torchrun-style training script, written the way nanoGPT's train.py is: DDP only if torchrun's RANK is set,
``init_process_group`` from the environment (env://), the model wrapped in DDP, a few AdamW steps on data that
differs per rank (seeded by rank, as nanoGPT offsets its seed). No autopar import at all.

argv: OUT_DIR. Each rank writes OUT_DIR/rank_<r>.pt: the world it saw, an all-reduce of the ranks, its parameters.
FAIL_RANK=r: that rank kills itself (SIGKILL) at step 3 while the others wait in the all-reduce.
"""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

out = sys.argv[1]
ddp = int(os.environ.get("RANK", -1)) != -1  # is this a ddp run?
if ddp:
    dist.init_process_group(backend="gloo")
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
else:
    rank, local_rank, world = 0, 0, 1
torch.manual_seed(1337 + rank)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
if ddp:
    model = DDP(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(5):
    if ddp and os.environ.get("FAIL_RANK") == str(rank) and step == 3:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
ranks = torch.tensor([float(rank)])
if ddp:
    dist.all_reduce(ranks)
torch.save({"world": dist.get_world_size() if ddp else 1, "rank_sum": ranks.item(), "local_rank": local_rank,
            "params": [p.detach().clone() for p in model.parameters()]}, os.path.join(out, f"rank_{rank}.pt"))
print(f"rank {rank} of {world}: rank sum {ranks.item()}", flush=True)
if ddp:
    dist.destroy_process_group()
