"""Saves integrated checkpoints of a ~25 MB model in a loop until killed: every parameter of checkpoint k is k.

argv: DIR. The test SIGKILLs this process at a random moment (mostly in the middle of a save) and then checks that
every checkpoint that looks complete loads and holds the right values."""
import sys

import torch

from autopar.checkpoint.store import CheckpointMeta, list_checkpoints, save_integrated

directory = sys.argv[1]
net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
k = 0
while True:
    k += 1
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(float(k))
    save_integrated(f"{directory}/big-1_{k}.ckpt", net, None, CheckpointMeta(epoch=1, step_in_epoch=k, global_step=k))
    print(f"SAVED {k}", flush=True)
    for old in list_checkpoints(directory)[:-2]:
        old.path.unlink()
