"""Worker: ``Model.train(resume_from=...)`` into a network built on the meta device reads each rank's slices straight
into its shard -- no initial value is computed for what the checkpoint holds, nothing is made whole -- and the run
continues as the uninterrupted one, to the last bit (float64).

argv: ROOT PHASE CASES, CASES a comma-separated list of MODE/BUILD. MODE zero3: ZeRO-3 over every rank; megatron:
SEMI_AUTO, fc1 column- and fc2 row-split, ZeRO-1 beside (what the strategy leaves whole is stored split over the
ranks after the first step, and saved so). BUILD lazy: the resumed network built under ``autopar.deferred_init``;
eager: built as usual. Phase ``save``, per case: a full run (eager, 4 steps) whose losses and parameters go to ROOT,
and a run of 2 steps (eager) that saves sliced checkpoints. Phase ``resume`` (a new process, as a restarted job is),
per case: the network resumed from that save for the last 2 steps. Writes ROOT/result.<rank>: per case the largest
difference of the resumed run's losses and parameters against the full run's, how many whole initial values the
resumed build computed (``computed``), and which parameters it held as slices (``sliced``).
"""
import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import autopar
import autopar.dataset as ds
from autopar.common import deferred
from autopar.communication import get_group_size, get_rank, init
from autopar.train import Callback, CheckpointConfig, Model, ModelCheckpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ckpt_common import MLP, X, Y  # noqa: E402

root, phase, cases = Path(sys.argv[1]), sys.argv[2], [c.split("/") for c in sys.argv[3].split(",")]
torch.set_default_dtype(torch.float64)
init()
rank, n = get_rank(), get_group_size()


class Losses(Callback):
    def __init__(self):
        self.losses = {}

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        self.losses[cb.cur_step_num] = float(cb.net_outputs)


computed = []
value = deferred.full_value


def counting(t):  # every whole initial value a materialisation computes
    computed.append(tuple(t.shape))
    return value(t)


deferred.full_value = counting


def run(mode: str, steps: int, directory: Path | None, resume: bool, lazy: bool):
    autopar.reset_auto_parallel_context()
    parallel = "semi_auto_parallel" if mode == "megatron" else "data_parallel"
    autopar.set_auto_parallel_context(parallel_mode=parallel, gradients_mean=True, enable_parallel_optimizer=True,
                                      parallel_optimizer_config={"optimizer_level": "level3" if mode == "zero3"
                                                                 else "level1"})
    torch.manual_seed(0)
    net = autopar.deferred_init(MLP) if lazy else MLP()
    if mode == "megatron":
        autopar.shard(net.fc1, ((1, 1), (n, 1)))
        autopar.shard(net.fc2, ((1, n), (1, n)))
    x, y = X[:64].astype("float64"), Y[:64].astype("int64")
    data = ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False, num_shards=n, shard_id=rank).batch(8)
    losses = Losses()
    callbacks = [losses]
    if directory is not None and not resume:
        callbacks.append(ModelCheckpoint("sl", directory, CheckpointConfig(save_checkpoint_steps=2,
                                                                           integrated_save=False)))
    model = Model(net, torch.nn.CrossEntropyLoss(), torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1))
    computed.clear()
    model.train(steps // 2, data.take(2), callbacks=callbacks, resume_from=directory if resume else None)
    whole = {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for k, p in net.named_parameters()}
    sliced = sorted(k for k, p in net.named_parameters() if isinstance(p, DTensor) and p.to_local().numel() < p.numel())
    return losses.losses, whole, sliced


results = {}
for mode, build in cases:
    if phase == "save":
        full_losses, full_params, _ = run(mode, 4, None, False, lazy=False)
        torch.save((full_losses, full_params), root / f"full_{mode}.{rank}")
        run(mode, 2, root / f"{mode}_{rank}", False, lazy=False)
        continue
    full_losses, full_params = torch.load(root / f"full_{mode}.{rank}")
    losses, params, sliced = run(mode, 4, root / f"{mode}_{rank}", True, lazy=build == "lazy")
    results[f"{mode}/{build}"] = {
        "steps": sorted(losses), "computed": len(computed), "sliced": sliced,
        "loss_diff": max(abs(losses[s] - full_losses[s]) for s in losses),
        "param_diff": max((params[k] - full_params[k]).abs().max().item() for k in full_params)}
if phase == "resume":
    (root / f"result.{rank}").write_text(json.dumps(results))
    print(f"rank {rank}: {json.dumps(results)}", flush=True)
