"""Worker for the restart test: DATA_PARALLEL training with integrated checkpoints every 2 steps, always asked to
resume; on the first attempt (AUTOPAR_RESTART=0) rank 1 dies abruptly after step 5 when CRASH=1; STEP_SLEEP seconds
after each step. Rank 0 writes
the final parameters and the steps it ran. argv: ROOT"""
import json
import os
import sys
import time
from pathlib import Path

import torch

import autopar
import autopar.dataset as ds
from autopar.communication import get_group_size, get_rank, init
from autopar.nn import Momentum
from autopar.train import Callback, CheckpointConfig, Model, ModelCheckpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ckpt_common import MLP, X, Y  # noqa: E402

root = Path(sys.argv[1])
autopar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True, parameter_broadcast=True)
init()
rank, n = get_rank(), get_group_size()
attempt = int(os.environ.get("AUTOPAR_RESTART", "0"))
torch.manual_seed(0)
net = MLP(dropout=0.2)
data = ds.NumpySlicesDataset({"x": X, "y": Y}, shuffle=True, num_shards=n, shard_id=rank).batch(12)
ran = []


class Step(Callback):
    def on_train_step_end(self, run_context):
        step = run_context.original_args().cur_step_num
        ran.append(step)
        if os.environ.get("CRASH") == "1" and attempt == 0 and rank == 1 and step == 5:
            os._exit(9)
        time.sleep(float(os.environ.get("STEP_SLEEP", "0")))  # time for a test to pull a cable mid-run


ckpt = ModelCheckpoint("job", root / f"ckpt_{rank}", CheckpointConfig(save_checkpoint_steps=2))
Model(net, torch.nn.CrossEntropyLoss(), Momentum(net.parameters(), 0.05, 0.9)).train(
    2, data, callbacks=[ckpt, Step()], resume_from=root / "ckpt_{rank}")
if rank == 0:
    torch.save(net.state_dict(), root / "final.pt")
    (root / f"steps_{attempt}.json").write_text(json.dumps(ran))
