"""Worker for the "killed while saving" tests: DATA_PARALLEL training with integrated checkpoints in per-rank
directories every 2 steps, always asked to resume. On the first attempt rank 1 is SIGKILLed as it starts writing
its step-6 checkpoint (rank 0 writes its own and goes on). Each rank records the steps it ran per attempt.

argv: ROOT KEEP (keep_checkpoint_max). ``--max-restarts 1`` runs the second attempt."""
import json
import os
import sys

import numpy as np
import torch

import autopar as ms
import autopar.dataset as ds
from autopar.checkpoint import store
from autopar.train import Callback, CheckpointConfig, Model, ModelCheckpoint

root, keep = sys.argv[1], int(sys.argv[2])
ms.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
ms.init()
rank, attempt = ms.get_rank(), int(os.environ["AUTOPAR_RESTART"])
write = store.write_integrated


def dying_write(path, model, optimizer, meta, rngs=None):
    if rank == 1 and attempt == 0 and meta.global_step == 6:
        os.kill(os.getpid(), 9)  # killed while writing its checkpoint
    return write(path, model, optimizer, meta, rngs)


store.write_integrated = dying_write
ran = []


class Record(Callback):
    def on_train_step_end(self, run_context):
        ran.append(run_context.original_args().cur_step_num)
        with open(os.path.join(root, f"ran_{rank}_{attempt}.json"), "w") as fh:
            json.dump(ran, fh)


torch.manual_seed(0)
net = torch.nn.Linear(4, 2)
x = np.random.default_rng(0).standard_normal((32, 4)).astype(np.float32)
y = (np.arange(32) % 2).astype(np.int64)
data = ds.NumpySlicesDataset({"x": x, "y": y}, num_shards=2, shard_id=rank).batch(2)
ckpt = ModelCheckpoint("net", os.path.join(root, f"ckpt_{rank}"),
                       CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=keep))
Model(net, torch.nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), 0.1)).train(
    1, data, callbacks=[ckpt, Record()], resume_from=os.path.join(root, "ckpt_{rank}"))
if rank == 0:
    torch.save(net.state_dict(), os.path.join(root, f"final_{attempt}.pt"))
