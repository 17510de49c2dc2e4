"""The two on-disk forms of an autopar checkpoint, and how to find the newest complete one.

- **integrated** (``integrated_save=True``): one file, ``torch.save`` of ``{"format", "kind", "model",
  "optimizer", "meta", "rng"}`` with *full* tensors (sliced parameters gathered first -- a collective, so every rank
  takes part even when only some write). Loads in a single process.
- **sliced** (``integrated_save=False``): a directory holding one rank's DCP checkpoint (its slices only, written
  without any collective), ``autopar.json`` (epoch/step, world size, rank, every parameter's Layout) and ``rng.pt``.
  The slices of all ranks together load onto any layout or world size through
  :class:`~autopar.checkpoint.merged_reader.MergedReader`.

Both are written atomically (:mod:`autopar.checkpoint.atomic`). Names follow MindSpore:
``{prefix}-{epoch}_{step}.ckpt`` (a directory in the sliced form).
"""
from __future__ import annotations

import contextlib
import json
import random
import re
import time
import warnings
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from autopar.checkpoint.atomic import TMP_MARK, atomic_dir, atomic_file
from autopar.errors import CheckpointError

FORMAT = "autopar-ckpt-1"
META_FILE = "autopar.json"
RNG_FILE = "rng.pt"
NAME = re.compile(r"^(?P<prefix>.+)-(?P<epoch>\d+)_(?P<step>\d+)\.ckpt$")


@dataclass
class CheckpointMeta:
    epoch: int = 0  # 1-based epoch the checkpoint was taken in (0: not from training)
    step_in_epoch: int = 0
    global_step: int = 0  # steps completed
    steps_per_epoch: int = 0
    rank: int = 0
    world_size: int = 1
    parallel_mode: str = "stand_alone"
    kind: str = "integrated"
    layouts: dict = field(default_factory=dict)  # parameter name -> Layout.to_dict() at save time
    loop_state: dict = field(default_factory=dict)  # the training loop's own state, JSON (e.g. "grad_scaler")
    created: float = field(default_factory=time.time)
    save_index: int = 0  # the how-manyth sliced save of its process: tells apart saves of one step (see save_id)

    def save_id(self) -> tuple:
        """What the slices of one save have in common (every rank makes the same saves, in the same order): the
        position in training, the world size, and for saves outside training (step 0) their number."""
        return (self.epoch, self.step_in_epoch, self.global_step, self.world_size,
                self.save_index if self.global_step == 0 else 0)

    def describe(self) -> str:
        where = f"epoch {self.epoch} step {self.step_in_epoch}" if self.global_step else f"save #{self.save_index}"
        return f"rank {self.rank} of {self.world_size}, {where}"

    @classmethod
    def from_dict(cls, d: dict) -> "CheckpointMeta":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def failure_reason(exc: BaseException) -> str:
    """The one line a user needs from a failed read or write: an OS error's reason (``No space left on device``)
    wherever it is -- also inside torch's ``CheckpointException``, which derives from ``BaseException`` and
    carries each rank's exception with its traceback -- else the exception's first line."""
    found: list[BaseException] = [exc]
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        found += [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]
    for e in found:
        cause = e
        while cause is not None:
            if isinstance(cause, OSError) and cause.strerror:
                return f"{cause.strerror}" + (f" ({cause.filename})" if cause.filename else "")
            cause = cause.__cause__ or cause.__context__
    inner = found[-1]
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[0]}" if text else type(inner).__name__


def dcp_errors():
    """The exceptions a DCP read or write may end with (``CheckpointException`` is a ``BaseException``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns that it "assumes a single process" whenever no_dist is used without a process group: that is
    exactly the intent here (each rank reads/writes its own files)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


# ------------------------------------------------------------------------------------------------------ RNG
def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict | None) -> None:
    if not state:
        return
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _optimizers(optimizer) -> list:
    if optimizer is None:
        return []
    from autopar.common.replaced import remap_optimizer

    remap_optimizer(optimizer)  # made before the network was laid out: it must name the parameters that train
    return [optimizer]


# --------------------------------------------------------------------------------------------------- writing
def _state_dict_api():
    """torch.distributed.checkpoint, imported when a checkpoint is touched: it pulls in DTensor and sympy (about
    1 s), which a training run that never saves should not pay at start-up."""
    from torch.distributed.checkpoint import state_dict

    return _SlicedStateDicts(state_dict)


class _SlicedStateDicts:
    """DCP's state-dict functions, reading and writing the networks' own slices: ``net.state_dict()`` of a laid-out
    network gives full tensors to a user (``autopar.parallel.tensor.state_dict``), DCP needs the DTensors."""

    def __init__(self, api):
        self._api = api
        self.StateDictOptions = api.StateDictOptions

    def get_state_dict(self, *args, **kwargs):
        from autopar.parallel.tensor.state_dict import sharded_state_dict

        with sharded_state_dict():
            return self._api.get_state_dict(*args, **kwargs)

    def set_state_dict(self, *args, **kwargs):
        from autopar.parallel.tensor.state_dict import sharded_state_dict

        with sharded_state_dict():
            return self._api.set_state_dict(*args, **kwargs)


def save_integrated(path: str | Path, network: torch.nn.Module, optimizer, meta: CheckpointMeta,
                    write: bool = True) -> None:
    """Gather full tensors (collective: call on every rank) and, where ``write``, save one file atomically."""
    from autopar.common import deferred

    deferred.make_whole(network)  # built on the meta device and not laid out yet: what is still meta is whole
    sd = _state_dict_api()
    model_sd, optim_sd = sd.get_state_dict(network, _optimizers(optimizer),
                                           options=sd.StateDictOptions(full_state_dict=True))
    rngs = [rng_state()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        rngs = [None] * dist.get_world_size()
        dist.all_gather_object(rngs, rng_state())
    if write:
        write_integrated(path, model_sd, optim_sd if optimizer else None, meta, rngs)


def write_integrated(path: str | Path, model: dict, optimizer: dict | None, meta: CheckpointMeta,
                     rngs: list | None = None) -> Path:
    """One integrated checkpoint file from full tensors already at hand, atomically (no collective)."""
    meta.kind = "integrated"
    obj = {"format": FORMAT, "kind": "integrated", "model": model, "optimizer": optimizer or None,
           "meta": asdict(meta), "rng": rngs or []}
    try:
        with atomic_file(path) as tmp, open(tmp, "wb") as fh:
            torch.save(obj, fh)  # through a Python file: a full disk is an OSError, not "unexpected pos 64 vs 0"
    except (OSError, RuntimeError) as exc:  # torch's zip writer turns the OSError into a RuntimeError on the way out
        raise CheckpointError(f"cannot write checkpoint {path}: {failure_reason(exc)}") from None
    return Path(path)


_SLICED_SAVES = 0  # sliced saves made by this process (every rank makes the same ones, in the same order)


def save_sliced(path: str | Path, network: torch.nn.Module, optimizer, meta: CheckpointMeta) -> None:
    """This rank's slices, as a self-contained DCP checkpoint directory (no collective)."""
    from autopar.common import deferred

    deferred.make_whole(network)  # built on the meta device and not laid out yet: what is still meta is whole
    sd = _state_dict_api()
    model_sd, optim_sd = sd.get_state_dict(network, _optimizers(optimizer),
                                           options=sd.StateDictOptions(full_state_dict=False))
    meta.kind = "sliced"
    global _SLICED_SAVES
    _SLICED_SAVES += 1
    meta.save_index = _SLICED_SAVES
    state = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    try:
        with atomic_dir(path) as tmp, quiet_single_process():
            import torch.distributed.checkpoint as dcp

            dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
            torch.save(rng_state(), tmp / RNG_FILE)
            (tmp / META_FILE).write_text(json.dumps({"format": FORMAT, **asdict(meta)}, indent=1))
    except dcp_errors() as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {failure_reason(exc)}") from None


# --------------------------------------------------------------------------------------------------- reading
def is_sliced(path: Path) -> bool:
    return path.is_dir() and (path / META_FILE).exists()


def read_meta(path: str | Path) -> CheckpointMeta:
    path = Path(path)
    if is_sliced(path):
        try:
            return CheckpointMeta.from_dict(json.loads((path / META_FILE).read_text()))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {path}: unreadable {META_FILE}: {exc}") from None
    return CheckpointMeta.from_dict(read_integrated(path).get("meta") or {})


def read_integrated(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory without {META_FILE}: not a (complete) autopar checkpoint")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not an autopar checkpoint (truncated or corrupt, or another format)")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds on damaged archives
        raise CheckpointError(f"{path} is truncated or corrupt: {str(exc).splitlines()[0]}") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an autopar checkpoint (no '{FORMAT}' marker)")
    return obj


def load_sliced_into(paths: list[Path], network: torch.nn.Module, optimizer=None, with_optimizer: bool = True,
                     own_slices_only: bool = False) -> None:
    """Read the ranks' slices (``paths``) into ``network`` (and ``optimizer``) in whatever layout they have now.

    ``own_slices_only``: ``paths`` is this rank's own checkpoint and the layout is the one it was saved under
    (resume), so this rank's slices are all it needs."""
    from autopar.common import deferred

    deferred.make_whole(network)  # built on the meta device and not laid out yet: what is still meta is whole
    sd = _state_dict_api()
    model_sd, optim_sd = sd.get_state_dict(network, _optimizers(optimizer),
                                           options=sd.StateDictOptions(full_state_dict=False))
    state = {"model": model_sd}
    if optimizer is not None and with_optimizer:
        state["optim"] = optim_sd
    from autopar.checkpoint.merged_reader import MergedReader, check_shapes

    # checked before DCP: a missing rank's file or another shape named with the files (DCP logs a traceback first)
    merged = MergedReader(paths, require_complete=not own_slices_only).read_metadata().state_dict_metadata
    check_shapes(merged, {k: tuple(v.shape) for k, v in model_sd.items() if isinstance(v, torch.Tensor)}, paths)
    if own_slices_only:  # what this rank's file does not hold stays NaN, for the caller to find and take from peers
        _fill_nan(state)
    try:
        with quiet_single_process():
            import torch.distributed.checkpoint as dcp

            from autopar.checkpoint.merged_reader import MergedReader

            dcp.load(state, storage_reader=MergedReader(paths, require_complete=not own_slices_only), no_dist=True)
    except CheckpointError:
        raise
    except dcp_errors() as exc:  # DCP reports missing keys, other shapes and bad files with assorted errors
        raise CheckpointError(f"loading {', '.join(map(str, paths[:3]))}: {failure_reason(exc)}") from None
    sd.set_state_dict(network, _optimizers(optimizer) if "optim" in state else [],
                      model_state_dict=state["model"], optim_state_dict=state.get("optim", {}),
                      options=sd.StateDictOptions(full_state_dict=False))


def _fill_nan(tree) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if isinstance(tree, DTensor) else tree
        if local.is_floating_point() and local.dim() > 0 and not local.is_meta:
            with torch.no_grad():
                local.fill_(float("nan"))
    elif isinstance(tree, dict):
        for v in tree.values():
            _fill_nan(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _fill_nan(v)


def load_integrated_into(obj: dict, network: torch.nn.Module, optimizer=None) -> None:
    saved = obj.get("optimizer") or {}
    stateless = bool(saved) and not _has_tensors(saved.get("state"))
    opts = _optimizers(optimizer) if optimizer is not None and saved and not stateless else []
    sd = _state_dict_api()
    sd.set_state_dict(network, opts, model_state_dict=obj["model"], optim_state_dict=saved if opts else {},
                      options=sd.StateDictOptions(full_state_dict=True, strict=True))
    if optimizer is not None and stateless:
        # an optimizer with no tensor state (SGD without momentum): DCP's full-state loader cannot place it ("Expected
        # device to be set"); its hyperparameters (a scheduled learning rate) are all there is to restore
        _load_param_groups(optimizer, saved.get("param_groups") or [])


def _has_tensors(tree) -> bool:
    if isinstance(tree, torch.Tensor):
        return tree.dim() > 0
    if isinstance(tree, dict):
        return any(_has_tensors(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_has_tensors(v) for v in tree)
    return False


def _load_param_groups(optimizer, groups: list) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(groups)} parameter groups, this one "
                              f"{len(optimizer.param_groups)}")
    for live, kept in zip(optimizer.param_groups, groups):
        live.update({k: v for k, v in kept.items() if k != "params"})


# ---------------------------------------------------------------------------------------------- discovery
@dataclass(frozen=True, order=True)
class Found:
    epoch: int
    step: int
    mtime: float
    path: Path


def list_checkpoints(directory: str | Path, prefix: str | None = None) -> list[Found]:
    """Complete checkpoints in ``directory``, oldest first (temporaries of interrupted saves are ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    out = []
    for entry in directory.iterdir():
        if TMP_MARK in entry.name:
            continue
        m = NAME.match(entry.name)
        if not m or (prefix is not None and m["prefix"] != prefix):
            continue
        try:
            if entry.is_dir() and not is_sliced(entry):
                continue
            mtime = entry.stat().st_mtime
        except FileNotFoundError:  # removed while listed (a saver rotating its checkpoints): not there any more
            continue
        out.append(Found(int(m["epoch"]), int(m["step"]), mtime, entry))
    return sorted(out)
