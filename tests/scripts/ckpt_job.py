"""Worker for the checkpoint tests. argv: MODE ROOT [PHASE]

- ``dp PHASE``   DATA_PARALLEL, integrated checkpoints in per-rank dirs ROOT/ckpt_<rank>, 12 steps (3 epochs x 4),
                 an MLP with dropout (the RNG state matters) on shuffled data; PHASE ``full`` runs through, ``crash``
                 dies after step 8, ``resume`` continues from the newest checkpoint. Rank 0 appends every step's loss
                 to ROOT/losses_<PHASE>.json; ``full`` also writes each rank's final state to ROOT/final_<rank>.pt.
- ``semi PHASE`` SEMI_AUTO_PARALLEL Megatron MLP (column / row), sliced checkpoints per rank every 2 steps plus an
                 integrated one in the shared ROOT/integrated; 6 steps; same phases (crash after step 5).
- ``load4``      4 ranks, the same MLP under other strategies: infer the layouts, load the semi run's slices, report
                 full tensors and predictions vs the integrated checkpoint in ROOT/load4_<rank>.json.
"""
import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import autopar
import autopar.dataset as ds
from autopar import load_checkpoint, load_distributed_checkpoint
from autopar.communication import get_group_size, get_rank, init
from autopar.nn import Momentum
from autopar.train import Callback, CheckpointConfig, Model, ModelCheckpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ckpt_common import MLP, PROBE, X, Y  # noqa: E402

mode, root = sys.argv[1], Path(sys.argv[2])
phase = sys.argv[3] if len(sys.argv) > 3 else ""
run = root / ("full" if phase in ("full", "") else f"interrupted_{mode}")  # crash and resume share checkpoints

class Recorder(Callback):
    def __init__(self, crash_after):
        self.crash_after = crash_after
        self.losses = {}

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        self.losses[cb.cur_step_num] = float(cb.net_outputs)
        if get_rank() == 0:
            (root / f"losses_{mode}_{phase}.json").write_text(json.dumps(self.losses))
        if cb.cur_step_num == self.crash_after:
            os._exit(17)  # die abruptly, as a killed worker would (no clean-up, no final checkpoint)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_dp():
    autopar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True, parameter_broadcast=True)
    init()
    rank, n = get_rank(), get_group_size()
    torch.manual_seed(0)
    net = MLP(dropout=0.3)
    data = ds.NumpySlicesDataset({"x": X, "y": Y}, shuffle=True, num_shards=n, shard_id=rank).batch(12)
    ckpt = ModelCheckpoint("dp", run / f"ckpt_{rank}", CheckpointConfig(save_checkpoint_steps=3, keep_checkpoint_max=2))
    model = Model(net, torch.nn.CrossEntropyLoss(), Momentum(net.parameters(), 0.05, 0.9))
    crash = 8 if phase == "crash" else -1
    model.train(3, data, callbacks=[ckpt, Recorder(crash)], resume_from=run / "ckpt_{rank}" if phase == "resume" else None)
    if phase == "full":
        torch.save(net.state_dict(), root / f"final_{rank}.pt")


def megatron(n, col, row):
    torch.manual_seed(0)
    net = MLP()
    autopar.shard(net.fc1, col)
    autopar.shard(net.fc2, row)
    return net


def run_semi():
    autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True)
    init()
    rank, n = get_rank(), get_group_size()
    net = megatron(n, ((1, 1), (n, 1)), ((1, n), (1, n)))
    data = ds.NumpySlicesDataset({"x": X, "y": Y}, shuffle=False, num_shards=n, shard_id=rank).batch(8)
    sliced = ModelCheckpoint("sl", run / f"ckpt_{rank}", CheckpointConfig(save_checkpoint_steps=2,
                                                                          integrated_save=False))
    callbacks = [sliced, Recorder(5 if phase == "crash" else -1)]
    if phase == "full":
        callbacks.append(ModelCheckpoint("in", run / "integrated", CheckpointConfig(save_checkpoint_steps=6)))
    model = Model(net, torch.nn.CrossEntropyLoss(), Momentum(net.parameters(), 0.1, 0.9))
    model.train(1, data, callbacks=callbacks, dataset_sink_mode=False,
                resume_from=run / "ckpt_{rank}" if phase == "resume" else None)
    if phase == "full":
        local = model.predict(PROBE[rank * 8 // n:(rank + 1) * 8 // n])
        parts = [torch.empty_like(local) for _ in range(n)]
        torch.distributed.all_gather(parts, local.contiguous())
        if rank == 0:
            torch.save(torch.cat(parts), root / "probe.pt")


def run_load4():
    autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True)
    init()
    rank, n = get_rank(), get_group_size()
    net = megatron(n, ((1, n), (1, n)), ((1, 1), (2, 1)))  # other strategies: fc1 row-split 4 ways, fc2 column 2
    data = ds.NumpySlicesDataset({"x": X, "y": Y}, shuffle=False, num_shards=n, shard_id=rank).batch(4)
    model = Model(net, torch.nn.CrossEntropyLoss(), Momentum(net.parameters(), 0.1, 0.9))
    layouts = model.infer_train_layout(data)
    files = [root / "full" / f"ckpt_{r}" / "sl-1_6.ckpt" for r in range(2)]
    load_distributed_checkpoint(net, files, layouts)
    integrated = load_checkpoint(root / "full" / "integrated" / "in-1_6.ckpt")
    diff = max((full(p.detach()) - integrated[k]).abs().max().item() for k, p in net.named_parameters())
    local = model.predict(PROBE[rank * 8 // n:(rank + 1) * 8 // n])
    probe = torch.load(root / "probe.pt")
    pred = (local - probe[rank * 8 // n:(rank + 1) * 8 // n]).abs().max().item()
    local_sizes = {k: (p.to_local() if isinstance(p, DTensor) else p).numel() for k, p in net.named_parameters()}
    (root / f"load4_{rank}.json").write_text(json.dumps({"param": diff, "pred": pred, "local_sizes": local_sizes}))


{"dp": run_dp, "semi": run_semi, "load4": run_load4}[mode]()
