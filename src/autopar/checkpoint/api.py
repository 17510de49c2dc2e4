"""MindSpore's checkpoint functions on top of :mod:`autopar.checkpoint.store`.

``save_checkpoint`` / ``load_checkpoint`` / ``load_param_into_net`` / ``load_distributed_checkpoint`` /
``merge_sliced_checkpoints``, plus ``resume_state`` used by ``Model.train(resume_from=...)``.
``load_checkpoint`` also reads MindSpore's own ``.ckpt`` files (protobuf), whose parameter names
``load_param_into_net`` maps onto the module (``gamma``/``beta``/``moving_mean``/``moving_variance``).
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopar.checkpoint import store
from autopar.checkpoint.store import CheckpointMeta
from autopar.errors import CheckpointError


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


# ------------------------------------------------------------------------------------------------------ saving
def save_checkpoint(save_obj: torch.nn.Module, ckpt_file_name: str | os.PathLike, integrated_save: bool = True,
                    async_save: bool = False, append_dict: dict | None = None, optimizer=None,
                    meta: CheckpointMeta | None = None, **_: Any) -> None:
    """Save a network (and optionally its optimizer). Integrated: one file of full tensors (call on every rank:
    sliced parameters are gathered); sliced: this rank's slices as a directory."""
    if not isinstance(save_obj, torch.nn.Module):
        raise CheckpointError("save_checkpoint: save_obj must be the network (a torch.nn.Module)")
    meta = meta or CheckpointMeta(rank=_rank(), world_size=_world())
    meta.layouts = layouts_of(save_obj)
    path = Path(ckpt_file_name)
    if path.suffix != ".ckpt":
        path = path.with_name(path.name + ".ckpt")
    from autopar.parallel.pipeline.runner import pipeline_of

    runner = pipeline_of(save_obj)
    with runner.full_parameters() if runner is not None else contextlib.nullcontext():
        # a pipeline stage holds only its own parameters current: every rank gets them all first
        if integrated_save:
            store.save_integrated(path, save_obj, optimizer, meta)
        else:
            store.save_sliced(path, save_obj, optimizer, meta)


def layouts_of(network: torch.nn.Module) -> dict:
    """Every parameter's Layout (as dicts) -- the strategy a checkpoint carries."""
    from autopar.parallel.api import runtime_of

    runtime = runtime_of(network)
    if runtime is not None:
        return {k: v.to_dict() for k, v in runtime.layouts().items()}
    from autopar.layout.layout import Layout

    return {n: Layout.replicated(tuple(p.shape), _world()).to_dict() for n, p in network.named_parameters()}


# ----------------------------------------------------------------------------------------------------- loading
def _is_mindspore_file(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as fh:
        head = fh.read(4)
    return head[:4] != b"PK\x03\x04"


def load_checkpoint(ckpt_file_name: str | os.PathLike, net: torch.nn.Module | None = None,
                    strict_load: bool = False, filter_prefix: Any = None, optimizer=None,
                    **_: Any) -> dict[str, torch.nn.Parameter]:
    """name -> Parameter of full tensors, from an integrated autopar checkpoint or a MindSpore ``.ckpt``; from one
    rank's sliced checkpoint (``integrated_save=False``) alone, each tensor this rank held whole and every other as
    this rank's slice, as MindSpore's ``load_checkpoint`` returns it (the r1.7 save/load page loads each rank's file
    so and merges them; :func:`load_distributed_checkpoint` takes all the files and gives whole tensors). With ``net``, also loads them into it; with ``net`` and
    ``optimizer`` (an autopar checkpoint saved with its optimizer), the optimizer's state too -- what a plain
    training loop resumes from, in whatever layout the network has now."""
    path = Path(ckpt_file_name)
    if optimizer is not None:
        if net is None:
            raise CheckpointError("load_checkpoint(optimizer=...) needs net= as well")
        if _is_mindspore_file(path):
            raise CheckpointError(f"{path} is a MindSpore checkpoint: it holds no autopar optimizer state")
        if store.is_sliced(path):
            store.load_sliced_into([path], net, optimizer)
        else:
            store.load_integrated_into(store.read_integrated(path), net, optimizer)
        net = None  # loaded with its optimizer: the parameters below are only returned, not loaded again
    if store.is_sliced(path):
        tensors = _rank_tensors_from_slices(path)
    elif _is_mindspore_file(path):
        from autopar.checkpoint.mindspore_ckpt import read_mindspore_checkpoint

        tensors = {k: torch.from_numpy(v.copy()) for k, v in read_mindspore_checkpoint(path).items()}
    else:
        tensors = store.read_integrated(path)["model"]
    prefixes = (filter_prefix,) if isinstance(filter_prefix, str) else tuple(filter_prefix or ())
    params = {k: torch.nn.Parameter(v.detach().clone(), requires_grad=v.is_floating_point())
              for k, v in tensors.items() if not k.startswith(prefixes) or not prefixes}
    if net is not None:
        load_param_into_net(net, params, strict_load=strict_load)
    return params


def _full_tensors_from_slices(paths: list[Path], reader: Any = None) -> dict[str, torch.Tensor]:
    """Merge the ranks' slices into full tensors (one process, no network needed)."""
    # As torch's own dcp_to_torch_save does: an empty state dict filled from the metadata (full tensors).
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from autopar.checkpoint.merged_reader import MergedReader

    state: dict = {}
    reader = reader or MergedReader(paths)
    reader.read_metadata()  # a missing or broken file named here, not logged with a traceback by DCP
    try:
        with store.quiet_single_process():
            _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(),
                             no_dist=True)
    except CheckpointError:
        raise
    except store.dcp_errors() as exc:
        raise CheckpointError(f"reading {paths[0]}: {store.failure_reason(exc)}") from None
    return state


def _rank_tensors_from_slices(path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of one rank's sliced checkpoint: whole where the rank held them whole, else its slice."""
    import math

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from autopar.checkpoint.merged_reader import MergedReader

    reader = MergedReader([path], require_complete=False)
    model = _full_tensors_from_slices([path], reader).get("model", {})  # a slice's rest stays unread (empty)
    meta = reader.metas[0]
    paths = meta.planner_data if isinstance(meta.planner_data, dict) else {}
    out = {}
    for fqn, info in meta.state_dict_metadata.items():
        where = tuple(paths.get(fqn, ("model", fqn[len("model."):]) if fqn.startswith("model.") else ()))
        if not isinstance(info, TensorStorageMetadata) or len(where) != 2 or where[0] != "model":
            continue
        name, full = where[1], model.get(where[1])
        if full is None:
            continue
        covered = sum(math.prod(c.sizes) for c in info.chunks)
        if covered >= math.prod(info.size):
            out[name] = full
        elif len(info.chunks) == 1:
            chunk = info.chunks[0]
            out[name] = full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))].clone()
        else:
            raise CheckpointError(f"{path}: this rank holds {len(info.chunks)} separate pieces of '{name}'; load "
                                  f"every rank's file with load_distributed_checkpoint")
    return out


def _ms_names_mapped(net: torch.nn.Module, parameter_dict: dict) -> dict:
    """MindSpore-named entries (gamma, moving_mean ...) under the module's own names."""
    if not any(k.endswith((".gamma", ".beta", ".moving_mean", ".moving_variance")) for k in parameter_dict):
        return parameter_dict
    from autopar.checkpoint.mindspore_names import mindspore_to_torch_state

    arrays = {k: v.detach().cpu().numpy() for k, v in parameter_dict.items()}
    model_state, _, _ = mindspore_to_torch_state(arrays, net, strict=False)
    return model_state


def load_param_into_net(net: torch.nn.Module, parameter_dict: dict, strict_load: bool = False) -> list[str]:
    """Copy full tensors into the network's parameters and buffers (each rank keeps only its slice of a
    sharded parameter). Returns the names of the network's parameters that were not in ``parameter_dict``;
    ``strict_load=True`` makes missing or unexpected names an error listing them."""
    entries = _ms_names_mapped(net, parameter_dict)
    own = dict(net.named_parameters())
    own.update({k: v for k, v in net.named_buffers() if k not in own})
    missing = [k for k in own if k not in entries and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in entries if k not in own]
    if strict_load and (missing or unexpected):
        raise CheckpointError(f"load_param_into_net(strict_load=True): missing {missing or 'none'}; "
                              f"unexpected {unexpected or 'none'}")
    with torch.no_grad():
        for name, target in own.items():
            if name not in entries:
                continue
            value = entries[name].detach()
            if tuple(value.shape) != tuple(target.shape):
                raise CheckpointError(f"parameter '{name}': the checkpoint has shape {tuple(value.shape)} but the "
                                      f"network has {tuple(target.shape)}")
            value = value.to(target.dtype)
            if target.is_meta:  # built under deferred_init / no_init_parameters: each rank takes its slice later
                from autopar.common import deferred

                deferred.assign(target, value)
            elif _is_dtensor(target):
                from torch.distributed.tensor import distribute_tensor

                local = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(local.to_local())
            else:
                target.copy_(value.to(target.device))
    return [k for k in missing if k in dict(net.named_parameters())]


def load_distributed_checkpoint(network: torch.nn.Module, checkpoint_filenames: list, predict_strategy: Any = None,
                                train_strategy_filename: str | None = None, strict_load: bool = False,
                                optimizer=None, **_: Any) -> None:
    """Load the slices saved by N ranks onto this process's layout (M ranks under ``predict_strategy``, or one
    process with full tensors when it is None). ``predict_strategy``: {name: Layout} (``Model.infer_train_layout``)
    or a strategy file path."""
    paths = checkpoint_paths(checkpoint_filenames)
    if not paths:
        raise CheckpointError("load_distributed_checkpoint: no checkpoint files given")
    for p in paths:
        if not p.exists():
            raise CheckpointError(f"checkpoint not found: {p}")
    if not all(store.is_sliced(p) for p in paths):
        if len(paths) == 1:  # an integrated file holds everything
            load_param_into_net(network, load_checkpoint(paths[0]), strict_load=strict_load)
            return
        raise CheckpointError(f"load_distributed_checkpoint takes the sliced checkpoints of the ranks; "
                              f"{[str(p) for p in paths if not store.is_sliced(p)]} are not")
    _check_ranks(paths)
    if predict_strategy is not None:
        from autopar.parallel.api import apply_layouts

        apply_layouts(network, predict_strategy)
    _check_names(network, paths, strict_load)
    store.load_sliced_into(paths, network, optimizer, with_optimizer=optimizer is not None)


def checkpoint_paths(given: Any) -> list[Path]:
    """The sliced checkpoints to read: a list of them; one of them; or one directory of per-rank directories
    (``ckpt_0/``, ``ckpt_1/``, ... -- the newest checkpoint every rank has), as ``autopar ckpt merge DIR``."""
    if isinstance(given, (str, os.PathLike)):
        given = [given]
    paths = [Path(p) for p in given]
    if len(paths) == 1 and paths[0].is_dir() and not store.is_sliced(paths[0]):
        return sliced_under(paths[0])
    return paths


def sliced_under(parent: Path) -> list[Path]:
    """A parent directory of per-rank directories: the newest checkpoint name every rank has; a rank directory
    without it is named (with the rank its other checkpoints say it is)."""
    ranks = [d for d in sorted(parent.iterdir()) if d.is_dir() and not store.is_sliced(d)
             and any(f.path.is_dir() for f in store.list_checkpoints(d))]
    names = [{f.path.name for f in store.list_checkpoints(d) if f.path.is_dir()} for d in ranks]
    if not ranks:
        raise CheckpointError(f"{parent}: no per-rank directory of sliced checkpoints in it")
    common = set.intersection(*names)
    if not common:
        raise CheckpointError(f"{parent}: no sliced checkpoint present in all of {[str(d) for d in ranks]}")
    newest = max(common, key=lambda n: tuple(int(x) for x in n[:-5].rsplit("-", 1)[1].split("_")))
    everywhere = set.union(*names)
    later = max(everywhere, key=lambda n: tuple(int(x) for x in n[:-5].rsplit("-", 1)[1].split("_")))
    if later != newest:  # the newest save lacks a rank: name it, rather than quietly take an older save
        lacking = "; ".join(f"{d} ({_rank_of_dir(d)}) has no {later}" for d, have in zip(ranks, names)
                            if later not in have)
        raise CheckpointError(f"{parent}: the newest save {later} is missing a rank's slices ({lacking}); "
                              f"give the checkpoints of an older save explicitly (the newest every rank has: "
                              f"{newest})")
    return [d / newest for d in ranks]


def _rank_of_dir(directory: Path) -> str:
    """Which rank's directory this is, as its checkpoints say."""
    for found in reversed(store.list_checkpoints(directory)):
        if found.path.is_dir():
            with contextlib.suppress(CheckpointError):
                meta = store.read_meta(found.path)
                return f"rank {meta.rank} of {meta.world_size}"
    return "rank unknown"


def _check_ranks(paths: list[Path]) -> None:
    """The slices given are those of one save (never rows of one step beside rows of another), each rank once,
    and none missing where parameters are split."""
    metas = [store.read_meta(p) for p in paths]
    if len({m.save_id() for m in metas}) > 1:
        listed = "; ".join(f"{p}: {m.describe()}" for p, m in zip(paths, metas))
        raise CheckpointError(f"the slices come from different saves ({listed}): give the slices of one save")
    ranks = [m.rank for m in metas]
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        raise CheckpointError(f"the slices of rank(s) {twice} are given twice: "
                              f"{', '.join(str(p) for p, m in zip(paths, metas) if m.rank in twice)}")
    world = metas[0].world_size
    have = {m.rank for m in metas}
    missing = sorted(set(range(world)) - have)
    if missing and any(_has_sliced_params(m) for m in metas):
        raise CheckpointError(f"the checkpoints were saved by {world} ranks under a sliced layout but the slices of "
                              f"ranks {missing} are missing (given: {sorted(have)})")


def _has_sliced_params(meta: CheckpointMeta) -> bool:
    return any(any(a >= 0 for a in lay.get("tensor_map", [])) for lay in meta.layouts.values())


def _saved_tensors(paths: list[Path], require_complete: bool = True) -> dict:
    """The network's tensors the sliced checkpoints ``paths`` hold: name -> DCP's metadata (its chunks)."""
    from autopar.checkpoint.merged_reader import MergedReader

    saved = MergedReader(paths, require_complete=require_complete).read_metadata().state_dict_metadata
    return {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")}


def _check_names(network: torch.nn.Module, paths: list[Path], strict: bool) -> None:
    saved = set(_saved_tensors(paths))
    own = {k for k, _ in network.named_parameters()}
    missing = sorted(own - saved)
    extra = sorted(k for k in saved - own if not k.endswith("num_batches_tracked") and k not in dict(network.named_buffers()))
    if missing:
        raise CheckpointError(f"the checkpoint lacks parameters of the network: {missing}")
    if strict and extra:
        raise CheckpointError(f"the checkpoint has tensors the network does not: {extra}")


def merge_sliced_checkpoints(checkpoint_filenames: list, out: str | os.PathLike) -> Path:
    """The ranks' slices -> one integrated checkpoint file (model and optimizer state, full tensors)."""
    paths = checkpoint_paths(checkpoint_filenames)
    for p in paths:
        if not p.exists():
            raise CheckpointError(f"checkpoint not found: {p}")
    _check_ranks(paths)
    state = _full_tensors_from_slices(paths)
    meta = store.read_meta(paths[0])
    meta.kind, meta.rank, meta.world_size = "integrated", 0, 1
    model, optim = state.get("model", {}), state.get("optim") or {}
    rngs = [torch.load(p / store.RNG_FILE, weights_only=False) for p in paths if (p / store.RNG_FILE).exists()]
    return store.write_integrated(out, model, optim or None, meta, rngs)


# ------------------------------------------------------------------------------------------------------ resume
def resolve_rank_path(directory: str | os.PathLike) -> Path:
    return Path(str(directory).replace("{rank}", str(_rank())))


def resume_state(directory: str | os.PathLike, network: torch.nn.Module, optimizer=None,
                 prefix: str | None = None, found: store.Found | None | bool = False) -> CheckpointMeta | None:
    """Load the newest checkpoint (of ``prefix``, if given) that *every* rank has completed in its ``directory``
    (``{rank}`` in the path is replaced by the rank). Returns its meta (the position to continue from), or None
    when there is none yet. ``found``: what :func:`find_resume` chose already (None: nothing to resume)."""
    directory = resolve_rank_path(directory)
    chosen = find_resume(directory, prefix) if found is False else found
    if chosen is None:
        return None
    meta = store.read_meta(chosen.path)
    if meta.world_size != _world():
        raise CheckpointError(f"{chosen.path} was saved by {meta.world_size} ranks but this job has {_world()}: "
                              f"reshard it with load_distributed_checkpoint (all ranks' slices) or merge it first")
    if store.is_sliced(chosen.path):
        from autopar.parallel.api import apply_layouts, takes_layouts

        if meta.layouts and takes_layouts(network):  # (else data parallel or ZeRO: read onto their layout)
            apply_layouts(network, {k: v for k, v in meta.layouts.items() if any(a >= 0 for a in v["tensor_map"])},
                          resumed=True)
        failure = None
        try:
            if meta.rank != _rank():
                raise CheckpointError(f"{chosen.path} holds the slices of rank {meta.rank}, but rank {_rank()} reads "
                                      f"it: resume each rank from its own directory ('{{rank}}' in resume_from)")
            # its own file first (what it lacks stays NaN): a run laid out as the saving one -- and a parameter preset
            # in its saved layout above -- needs no more; what it holds whole now takes the rest from its peers
            store.load_sliced_into([chosen.path], network, optimizer, own_slices_only=True)
        except CheckpointError as exc:
            failure = exc
        _every_rank_read(failure, chosen.path)  # (before any collective: a rank that failed alone hangs no other)
        lost = _whole_from_peers(network, optimizer)
        if lost:  # split otherwise than saved (ZeRO in place of a layout): DCP reshards every rank's slices onto it
            everyone = _every_ranks_checkpoint(chosen.path)
            if everyone is None:
                raise CheckpointError(f"resume from {chosen.path}: this rank's checkpoint lacks part of "
                                      f"{', '.join(lost[:3])}{' and more' if len(lost) > 3 else ''}, laid out otherwise "
                                      f"than in the run that saved it (or NaN there), and it cannot read the other "
                                      f"ranks' checkpoints -- put every rank's checkpoint where every rank can read "
                                      f"it (one file system), or resume with the saved layout")
            store.load_sliced_into(everyone, network, optimizer)
        store.set_rng_state(torch.load(chosen.path / store.RNG_FILE, weights_only=False))
    else:
        obj = store.read_integrated(chosen.path)
        store.load_integrated_into(obj, network, optimizer)
        rngs = obj.get("rng") or []
        store.set_rng_state(rngs[_rank()] if _rank() < len(rngs) else (rngs[0] if rngs else None))
    return meta


def _every_rank_read(failure: CheckpointError | None, path: Path) -> None:
    """Collective: raise on every rank if any rank could not read its own checkpoint (its own error where it
    failed, one naming the others elsewhere)."""
    from autopar.comm.management import any_rank

    if any_rank(failure is not None) and failure is None:
        raise CheckpointError(f"resume from {path}: another rank could not read its checkpoint (its log says why)")
    if failure is not None:
        raise failure


def _every_ranks_checkpoint(path: Path) -> list[Path] | None:
    """The checkpoint every rank resumes from, in rank order, where this rank can read all of them (one file system
    for the job), else None; every rank answers alike, so that all take the same way."""
    if _world() == 1:
        return [path]
    paths: list = [None] * _world()
    dist.all_gather_object(paths, str(path))
    from autopar.comm.management import any_rank

    unreadable = any_rank(not all(_holds_rank(Path(p), r) for r, p in enumerate(paths)))
    return None if unreadable else [Path(p) for p in paths]


def _holds_rank(path: Path, rank: int) -> bool:
    """Is ``path`` (as this rank sees it) a complete sliced checkpoint of ``rank``?"""
    try:
        return (path / ".metadata").is_file() and store.read_meta(path).rank == rank
    except (CheckpointError, OSError, ValueError):
        return False


def _whole_from_peers(network: torch.nn.Module, optimizer) -> list[str]:
    """After each rank read only its own file, what it did not find there is NaN (``load_sliced_into``). A tensor
    whole on every rank now -- a parameter, buffer or optimizer state the saving run split (ZeRO beside the layouts
    stores what the strategy leaves whole split over the ranks after the first step, and saves it so; a ZeRO-1
    save's moments) -- takes every element from the lowest rank that read it (exact: a sum with zeros elsewhere).
    Returns what is still missing, the same on every rank: the tensors this run splits otherwise than the saving
    run did, which no exchange of whole tensors fills."""
    from autopar.checkpoint.store import _optimizers
    from autopar.comm import management

    tensors = [(n, t) for n, t in [*network.named_parameters(), *network.named_buffers()]]
    names = {id(t): n for n, t in tensors}
    for opt in _optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                for key, v in (opt.state.get(p) or {}).items():
                    tensors.append((f"{names.get(id(p), '?')} ({key})", v))
    tensors = [(n, t) for n, t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0
               and not t.is_meta]
    if not tensors:
        return []

    def local(t):
        return t.to_local() if _is_dtensor(t) else t

    on = management.device() if _world() > 1 else torch.device("cpu")  # the process group's (NCCL: not the CPU)
    missing = torch.tensor([int(bool(torch.isnan(local(t)).any())) for _, t in tensors], dtype=torch.int32, device=on)
    split = torch.tensor([int(_is_dtensor(t) and not all(p.is_replicate() for p in t.placements)) for _, t in tensors],
                         dtype=torch.int32, device=on)
    if _world() == 1:
        return [name for (name, _), gone in zip(tensors, missing.tolist()) if gone]
    dist.all_reduce(missing, op=dist.ReduceOp.MAX)
    dist.all_reduce(split, op=dist.ReduceOp.MAX)
    flags = list(zip(tensors, missing.tolist(), split.tolist()))
    lost = [name for (name, _), gone, apart in flags if gone and apart]
    if lost:  # read again from every rank's save, all of it: nothing is worth taking from the peers first
        return lost
    for (name, t), gone, _ in flags:
        if not gone:
            continue
        mine = local(t).detach().to(on)
        owner = torch.where(torch.isnan(mine), torch.tensor(_world(), dtype=torch.int32, device=on),
                            torch.tensor(_rank(), dtype=torch.int32, device=on))
        dist.all_reduce(owner, op=dist.ReduceOp.MIN)
        if bool((owner == _world()).any()):
            lost.append(name)
            continue
        taken = torch.where(owner == _rank(), mine, torch.zeros((), dtype=mine.dtype, device=on))
        dist.all_reduce(taken)
        with torch.no_grad():
            local(t).copy_(taken)
    return lost


def find_resume(directory: str | os.PathLike, prefix: str | None = None) -> store.Found | None:
    """The newest checkpoint (of ``prefix``) every rank has completed in its ``directory``, or None (every rank
    calls it: the ranks compare what they hold)."""
    directory = resolve_rank_path(directory)
    found = {(f.epoch, f.step): f for f in store.list_checkpoints(directory, prefix)}
    keys = set(found)
    everyone = [sorted(keys)]
    if _world() > 1:
        everyone = [None] * _world()
        dist.all_gather_object(everyone, sorted(keys))
        keys = set.intersection(*(set(map(tuple, k)) for k in everyone))
    if not keys:
        if any(everyone):  # starting over would throw away every rank's progress, and its pruning the files
            held = "; ".join(f"rank {r}: " + (", ".join(f"epoch {e} step {s}" for e, s in k) or "none")
                             for r, k in enumerate(everyone))
            raise CheckpointError(f"resume from {directory}: checkpoints were found but none that every rank "
                                  f"completed ({held}); nothing was loaded or removed -- restore the missing ones, "
                                  f"or move them all away to start over")
        return None
    return found[max(keys)]


def sliced_names(found: store.Found | None) -> set[str]:
    """The network's tensors a sliced checkpoint holds (none for an integrated one, or none at all)."""
    if found is None or not store.is_sliced(found.path):
        return set()
    return set(_saved_tensors([found.path], require_complete=False))


def _is_dtensor(t: Any) -> bool:
    """Without importing DTensor (about 1 s of start-up) when nothing has: no DTensor can exist before that."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)
