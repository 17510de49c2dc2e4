"""``CheckpointConfig`` and ``ModelCheckpoint``: MindSpore's checkpoint callback, on autopar's checkpoint store.

Each rank saves into its own ``directory`` (as the tutorial's ``"./ckpt_" + str(get_rank())``); when ranks share
one directory, an integrated checkpoint is written once (by rank 0) and sliced ones go to ``rank_<r>/``
sub-directories, so ranks never overwrite each other. At most ``keep_checkpoint_max`` checkpoints of the prefix
are kept -- but pruning never removes the newest checkpoint that every rank has completed: a rank prunes only once
all ranks finished the save just made (a tiny all-reduce after it), so a rank killed while writing leaves every
other rank holding the previous common checkpoint, and a resume continues from it. A checkpoint holds parameters, optimizer state, epoch/step, RNG state, the dynamic loss scale (if any) and
every parameter's layout.
With gradient accumulation, a save that falls due inside an accumulation is taken at its last micro-batch, so that
resuming from any checkpoint continues exactly like the uninterrupted run.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch.distributed as dist

from autopar.checkpoint import store
from autopar.checkpoint.api import layouts_of
from autopar.checkpoint.atomic import remove_stale_temporaries
from autopar.checkpoint.store import CheckpointMeta
from autopar.comm.management import any_rank
from autopar.errors import ConfigError
from autopar.train.callbacks import Callback, RunContext, step_in_epoch


class CheckpointConfig:
    def __init__(self, save_checkpoint_steps: int = 1, save_checkpoint_seconds: float = 0,
                 keep_checkpoint_max: int = 5, keep_checkpoint_per_n_minutes: float = 0,
                 integrated_save: bool = True, async_save: bool = False, saved_network=None, append_info=None,
                 **_: object):
        if save_checkpoint_steps is not None and (not isinstance(save_checkpoint_steps, int) or save_checkpoint_steps < 0):
            raise ConfigError(f"save_checkpoint_steps must be a non-negative int, got {save_checkpoint_steps!r}")
        if not isinstance(keep_checkpoint_max, int) or keep_checkpoint_max < 1:
            raise ConfigError(f"keep_checkpoint_max must be a positive int, got {keep_checkpoint_max!r}")
        self.save_checkpoint_steps = save_checkpoint_steps or 0
        self.save_checkpoint_seconds = float(save_checkpoint_seconds or 0)
        self.keep_checkpoint_max = keep_checkpoint_max
        self.integrated_save = integrated_save
        self.saved_network = saved_network


class ModelCheckpoint(Callback):
    def __init__(self, prefix: str = "CKP", directory: str | os.PathLike | None = None,
                 config: CheckpointConfig | None = None):
        if not prefix or "/" in prefix:
            raise ConfigError(f"invalid checkpoint prefix {prefix!r}")
        self.prefix = prefix
        self.directory = Path(directory) if directory is not None else Path(".")
        self.config = config or CheckpointConfig()
        self._last_time = time.monotonic()
        self._last_step = -1
        self._write = True
        self._pending = False  # a save fell due inside a gradient accumulation: taken at its end
        self._prefix_checked = False  # the prefix is made unique once, on this callback's first training
        self.saved: list[Path] = []

    # -- where -----------------------------------------------------------------------------------------------------
    def on_train_begin(self, run_context: RunContext) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if world > 1:
            dirs = [None] * world
            dist.all_gather_object(dirs, str(self.directory.resolve()))
            if dirs.count(str(self.directory.resolve())) > 1:  # shared with another rank
                if self.config.integrated_save:
                    self._write = rank == 0
                else:
                    self.directory = self.directory / f"rank_{rank}"
        self.directory.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.directory, self.prefix)
        if not self._prefix_checked:
            self._prefix_checked = True
            args = run_context.original_args()
            step = args.get("cur_step_num", 0) if isinstance(args, dict) else getattr(args, "cur_step_num", 0)
            if not step:  # a fresh run (a resumed one goes on with its own files)
                prefix = unused_prefix(self.directory, self.prefix)
                if prefix != self.prefix and self._write:
                    print(f"[autopar] checkpoint prefix {self.prefix!r} is taken in {self.directory}: this run saves "
                          f"as {prefix!r} (MindSpore's rule; the other run's files are kept)", flush=True)
                self.prefix = prefix
        self._last_time = time.monotonic()

    # -- when ------------------------------------------------------------------------------------------------------
    def on_train_step_end(self, run_context: RunContext) -> None:
        cb = run_context.original_args()
        steps = self.config.save_checkpoint_steps
        due = bool(steps) and cb.cur_step_num % steps == 0
        if cb.dataset_sink_mode and steps:  # one callback per sink: save if a multiple fell inside it
            due = cb.cur_step_num // steps != (cb.cur_step_num - cb.get("steps_since_callback", 1)) // steps
        secs = self.config.save_checkpoint_seconds
        if secs and time.monotonic() - self._last_time >= secs:
            due = True
        if secs:  # every rank must agree (integrated saves are collective)
            due = any_rank(due)
        # Inside a gradient accumulation the micro-batches' gradients so far live only in .grad (per rank, not
        # all-reduced yet) and a checkpoint would not hold them: resuming there would lose them. The parameters
        # cannot have changed since the last boundary anyway, so a due save waits for the accumulation to end.
        self._pending = self._pending or due
        if self._pending and cb.cur_step_num % max(1, cb.get("grad_accumulation_steps", 1)) == 0:
            self._pending = False
            self.save(cb)

    def on_train_end(self, run_context: RunContext) -> None:
        cb = run_context.original_args()
        if cb.cur_step_num != self._last_step and cb.cur_step_num > 0:  # MindSpore saves the final state too
            self.save(cb)

    # -- how -------------------------------------------------------------------------------------------------------
    def save(self, cb) -> Path:
        network = self.config.saved_network or cb.train_network
        world = dist.get_world_size() if dist.is_initialized() else 1
        meta = CheckpointMeta(epoch=cb.cur_epoch_num, step_in_epoch=step_in_epoch(cb), global_step=cb.cur_step_num,
                              steps_per_epoch=cb.batch_num, rank=dist.get_rank() if dist.is_initialized() else 0,
                              world_size=world, parallel_mode=cb.parallel_mode, layouts=layouts_of(network),
                              loop_state=_loop_state(cb))
        path = self.directory / f"{self.prefix}-{cb.cur_epoch_num}_{step_in_epoch(cb)}.ckpt"
        optimizer = cb.optimizer
        if self.config.integrated_save:
            store.save_integrated(path, network, optimizer, meta, write=self._write)
        else:
            store.save_sliced(path, network, optimizer, meta)
        self._last_step = cb.cur_step_num
        self._last_time = time.monotonic()
        _all_ranks_done()  # from here on, this save is complete on every rank: older ones may go
        if self._write:
            self.saved.append(path)
            self._prune(path)
        return path

    def _prune(self, newest: Path) -> None:
        """Keep ``keep_checkpoint_max`` checkpoints: ``newest`` (the save every rank just completed) and the newest
        others before it. Files of a later step than it were left by an attempt that died (the resume went back
        to an older common step and abandoned them): they go first."""
        import shutil

        existing = store.list_checkpoints(self.directory, self.prefix)  # oldest first
        mine = next((f for f in existing if f.path == newest), None)
        if mine is None:
            doomed = existing[: max(0, len(existing) - self.config.keep_checkpoint_max)]
        else:
            others = [f for f in existing if f is not mine]
            abandoned = [f for f in others if (f.epoch, f.step) > (mine.epoch, mine.step)]
            older = [f for f in others if f not in abandoned]
            doomed = abandoned + older[: max(0, len(older) - (self.config.keep_checkpoint_max - 1))]
        for old in doomed:
            if old.path.is_dir():
                shutil.rmtree(old.path, ignore_errors=True)
            else:
                old.path.unlink(missing_ok=True)

    @property
    def latest_ckpt_file_name(self) -> str | None:
        found = store.list_checkpoints(self.directory, self.prefix)
        return str(found[-1].path) if found else None


def unused_prefix(directory: Path, prefix: str) -> str:
    """MindSpore's rule for a prefix that checkpoints in ``directory`` already use (its
    ``_chg_ckpt_file_name_if_same_exist``): ``prefix_N``, N one more than the largest in use (``prefix`` itself
    counts as 0), so a second run -- the tutorial's data-parallel block after its AUTO block -- neither overwrites nor
    prunes the first one's files (``auto_parallel-1_4.ckpt``, then ``auto_parallel_1-1_4.ckpt``)."""
    suffix = 0
    for found in store.list_checkpoints(directory):
        name = store.NAME.match(found.path.name)["prefix"]
        if name == prefix:
            suffix = max(suffix, 1)
        elif name.startswith(prefix + "_") and name[len(prefix) + 1:].isdigit():
            suffix = max(suffix, int(name[len(prefix) + 1:]) + 1)
    return f"{prefix}_{suffix}" if suffix else prefix


def _loop_state(cb) -> dict:
    """What the loop needs besides parameters, optimizer and RNG to continue exactly: the dynamic loss scale (O2 with
    float16) -- restarted at its initial 65536 it would skip steps to overflow again until it has backed off."""
    scaler = cb.get("grad_scaler")
    state = scaler.state_dict() if scaler is not None else {}
    return {"grad_scaler": state} if state else {}


def _all_ranks_done() -> None:
    """Returns once every rank got here (a barrier as a one-element all-reduce: it fails, rather than waits, when a
    rank died -- the job is then stopped by the cluster layer)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        import torch

        dist.all_reduce(torch.zeros(1))


