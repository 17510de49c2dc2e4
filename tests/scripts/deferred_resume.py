"""Worker: ``Model.train(resume_from=...)`` into a network built on the meta device reads each rank's slices straight
into its shard -- no initial value is computed for what the checkpoint holds, nothing is made whole -- and the run
continues as the uninterrupted one, to the last bit (float64).

argv: ROOT PHASE CASES, CASES a comma-separated list of MODE/BUILD, MODE either one mode (the saving run's and the
resumed run's) or SAVED>RESUMED (the resumed run lays the network out otherwise). Modes: zero3: ZeRO-3 over every rank;
zero1: data parallel with ZeRO-1; megatron: SEMI_AUTO, fc1 column- and fc2 row-split, ZeRO-1 beside (what the
strategy leaves whole is stored split over the ranks after the first step, and saved so); columns / rows: SEMI_AUTO
with fc1 alone split by columns (its output) / rows (its input), fc2 whole; auto: AUTO_PARALLEL; auto_tight: AUTO
with a memory limit data parallel does not fit. BUILD lazy: the resumed network built under ``autopar.deferred_init``;
eager: built as usual; a ``_private`` suffix: each rank resumes from ``./ckpt`` in a directory of its own, as ranks on
hosts without a shared file system do (no rank can read another's checkpoint). Phase ``save``, per case: a full run
(eager, 4 steps) whose losses and parameters go to ROOT, and a run of 2 steps (eager) that saves sliced checkpoints.
Phase ``resume`` (a new process, as a restarted job is), per case: the network resumed from that save for the last 2
steps. Writes ROOT/result.<rank>: per case the largest difference of the resumed run's losses and parameters against
the full run's, how many whole initial values the resumed build computed (``computed``), which parameters it held as
slices (``sliced``), how fc1's weight lay (``layout``) and the one-line error, if the resume refused (and what training that Model again then said).
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
from autopar.errors import CheckpointError, ConfigError
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


class Refused(Exception):
    pass


def run(mode: str, steps: int, directory: Path | None, resume: bool, lazy: bool):
    autopar.reset_auto_parallel_context()
    parallel = {"megatron": "semi_auto_parallel", "columns": "semi_auto_parallel", "rows": "semi_auto_parallel",
                "auto": "auto_parallel", "auto_tight": "auto_parallel"}.get(mode, "data_parallel")
    autopar.set_auto_parallel_context(parallel_mode=parallel, gradients_mean=True)
    if mode in ("zero3", "zero1", "megatron"):
        autopar.set_auto_parallel_context(enable_parallel_optimizer=True, parallel_optimizer_config={
            "optimizer_level": "level3" if mode == "zero3" else "level1"})
    if mode == "auto_tight":  # the MLP's data parallel needs ~23 KB a rank by the plan: AUTO must split it
        autopar.set_auto_parallel_context(max_device_memory="20KB")
    torch.manual_seed(0)
    net = autopar.deferred_init(MLP) if lazy else MLP()
    if mode == "megatron":
        autopar.shard(net.fc1, ((1, 1), (n, 1)))
        autopar.shard(net.fc2, ((1, n), (1, n)))
    elif mode in ("columns", "rows"):
        autopar.shard(net.fc1, ((1, 1), (n, 1)) if mode == "columns" else ((1, n), (1, n)))
    x, y = X[:64].astype("float64"), Y[:64].astype("int64")
    data = ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False, num_shards=n, shard_id=rank).batch(8)
    losses = Losses()
    callbacks = [losses]
    if directory is not None and not resume:
        callbacks.append(ModelCheckpoint("sl", directory, CheckpointConfig(save_checkpoint_steps=2,
                                                                           integrated_save=False)))
    model = Model(net, torch.nn.CrossEntropyLoss(), torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1))
    computed.clear()
    try:
        model.train(steps // 2, data.take(2), callbacks=callbacks, resume_from=directory if resume else None)
    except CheckpointError as exc:  # refused after reading part of it: the network holds no values to train on
        try:
            model.train(1, data.take(1))
            again = "trained"
        except ConfigError as retry:
            again = str(retry)
        raise Refused(str(exc), again, layout(net)) from None
    whole = {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for k, p in net.named_parameters()}
    sliced = sorted(k for k, p in net.named_parameters() if isinstance(p, DTensor) and p.to_local().numel() < p.numel())
    return losses.losses, whole, sliced, layout(net)


def layout(net) -> str:
    """How fc1's weight lies on this rank: AUTO's pick under a tight budget rests on timings measured here (data
    parallel + ZeRO-1, the weight's dim 0 split, or a searched layout, perhaps its dim 1 as ``rows`` saved it), and
    each pick has its own right answer."""
    w = net.fc1.weight
    return str(tuple(w.placements)) if isinstance(w, DTensor) else "whole"


results = {}
for case in cases:
    modes, build = case
    saved, resumed = modes.split(">") if ">" in modes else (modes, modes)
    key = f"{modes}/{build}"
    tag = key.replace("/", "-").replace(">", "-to-")
    private = build.endswith("_private")
    if phase == "save":
        full_losses, full_params, _ = run(saved, 4, None, False, lazy=False)[:3]
        torch.save((full_losses, full_params), root / f"full_{tag}.{rank}")
        saves = root / (f"{tag}-rank{rank}/ckpt" if private else f"{tag}_{rank}")
        run(saved, 2, saves, False, lazy=False)
        continue
    full_losses, full_params = torch.load(root / f"full_{tag}.{rank}")
    here = os.getcwd()
    if private:  # "./ckpt": the path every rank gives names its own directory alone
        os.chdir(root / f"{tag}-rank{rank}")
    try:
        losses, params, sliced, placed = run(resumed, 4, Path("ckpt") if private else root / f"{tag}_{rank}", True,
                                     lazy=build.startswith("lazy"))
    except Refused as exc:
        results[key] = {"error": exc.args[0], "again": exc.args[1], "layout": exc.args[2]}
        continue
    finally:
        os.chdir(here)
    results[key] = {
        "steps": sorted(losses), "computed": len(computed), "sliced": sliced, "layout": placed,
        "loss_diff": max(abs(losses[s] - full_losses[s]) for s in losses),
        "param_diff": max((params[k] - full_params[k]).abs().max().item() for k in full_params)}
if phase == "resume":
    (root / f"result.{rank}").write_text(json.dumps(results))
    print(f"rank {rank}: {json.dumps(results)}", flush=True)
