"""A DCP ``StorageReader`` over the sliced checkpoints of several ranks, so resharding is DCP's own job.

With ``integrated_save=False`` every rank writes a self-contained DCP checkpoint of *its* slices (no collective,
so each rank may use its own directory, even on hosts without a shared file system). Loading them onto any other
layout or world size is one ``dcp.load`` through this reader: it merges the ranks' metadata (the union of the
chunks; replicas of a chunk are read once) and routes each read to the file that holds the chunk. Before loading
it checks that the chunks of every tensor cover it entirely -- a missing rank is an error naming the tensor,
never a silently uninitialised slice.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import collect_all

from autopar.errors import CheckpointError


class MergedReader(StorageReader):
    def __init__(self, paths: list[str | Path], require_complete: bool = True):
        super().__init__()
        self.require_complete = require_complete
        if not paths:
            raise CheckpointError("no checkpoint given")
        self.paths = [Path(p) for p in paths]
        self.readers = [FileSystemReader(str(p)) for p in self.paths]
        self.metas: list[Metadata] = []
        self.owner: dict = {}

    def reset(self, checkpoint_id=None) -> None:  # noqa: D102 - StorageReader API
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def read_metadata(self) -> Metadata:
        self.metas = []
        for path, reader in zip(self.paths, self.readers):
            if not (path / ".metadata").is_file():
                raise CheckpointError(f"checkpoint {path} ({_whose(path)}) has no .metadata: that rank's save did not "
                                      f"complete -- give a save every rank completed")
            try:
                self.metas.append(reader.read_metadata())
            except Exception as exc:  # noqa: BLE001 - any unreadable metadata is a broken checkpoint
                raise CheckpointError(f"checkpoint {path} ({_whose(path)}) is incomplete or corrupt: "
                                      f"{str(exc).splitlines()[0]}") from None
            files = sorted({info.relative_path for info in reader_storage(self.metas[-1])})
            lost = [f for f in files if not (path / f).is_file()]
            if lost:
                raise CheckpointError(f"checkpoint {path} ({_whose(path)}) lacks {', '.join(lost)}, which its .metadata "
                                      f"lists: that rank's slices are lost -- give a save every rank completed")
        merged: dict = {}
        storage: dict = {}
        for k, md in enumerate(self.metas):
            for fqn, meta in md.state_dict_metadata.items():
                if isinstance(meta, TensorStorageMetadata):
                    into = merged.setdefault(fqn, TensorStorageMetadata(meta.properties, meta.size, []))
                    if tuple(into.size) != tuple(meta.size):
                        raise CheckpointError(f"'{fqn}' has shape {tuple(meta.size)} in {self.paths[k]} but "
                                              f"{tuple(into.size)} in another checkpoint: not slices of one tensor")
                    seen = {tuple(c.offsets) for c in into.chunks}
                    into.chunks.extend(c for c in meta.chunks if tuple(c.offsets) not in seen)
                else:
                    merged.setdefault(fqn, meta)
            for index, info in md.storage_data.items():
                if index not in storage:
                    storage[index] = info
                    self.owner[index] = k
        if self.require_complete:
            check_coverage(merged, self.paths)
        planner_data: dict = {}  # how DCP flattened nested dicts ("optim.state.<fqn>..."): the same for every rank
        for md in self.metas:
            if isinstance(md.planner_data, dict):
                planner_data.update(md.planner_data)
        return Metadata(state_dict_metadata=merged, storage_data=storage, planner_data=planner_data or None)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        for reader, md in zip(self.readers, self.metas):
            reader.set_up_storage_reader(md, is_coordinator)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner):
        groups: dict[int, list] = {}
        for item in plan.items:
            groups.setdefault(self.owner[item.storage_index], []).append(item)
        futures = []
        for k, items in groups.items():
            try:
                futures.append(self.readers[k].read_data(LoadPlan(items), planner))
            except Exception as exc:  # noqa: BLE001
                raise CheckpointError(f"reading {self.paths[k]} failed (truncated or corrupt?): "
                                      f"{str(exc).splitlines()[0]}") from None
        if not futures:
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(None)
            return done
        return collect_all(futures).then(lambda _: None)


def reader_storage(md: Metadata) -> list:
    """The storage entries (file, offset, length) a checkpoint's metadata lists."""
    return list((md.storage_data or {}).values())


def _whose(path: Path) -> str:
    """"rank r of n" from the checkpoint's own autopar.json, for naming the rank whose files are missing."""
    import json

    try:
        meta = json.loads((path / "autopar.json").read_text())
        return f"rank {meta.get('rank')} of {meta.get('world_size')}"
    except (OSError, ValueError):
        return "rank unknown"


def check_shapes(merged: dict, network_shapes: dict[str, tuple], paths: list[Path]) -> None:
    """The saved tensor of each of the network's parameters must have the network's (full) shape: named with the
    files and both shapes, before DCP fails deep inside its planner."""
    for name, shape in network_shapes.items():
        meta = merged.get(f"model.{name}")
        if isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(shape):
            files = ", ".join(str(p) for p in paths[:3]) + (" ..." if len(paths) > 3 else "")
            raise CheckpointError(f"'{name}' has shape {tuple(meta.size)} in the checkpoint ({files}) but "
                                  f"{tuple(shape)} in the network")


def check_coverage(merged: dict, paths: list[Path]) -> None:
    """Every tensor's chunks must add up to the whole tensor (chunks of distinct offsets never overlap in
    checkpoints written from layouts)."""
    for fqn, meta in merged.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        total = math.prod(meta.size) if len(meta.size) else 1
        covered = sum(math.prod(c.sizes) if len(c.sizes) else 1 for c in meta.chunks)
        if covered < total:
            raise CheckpointError(
                f"the checkpoints given ({len(paths)}: {', '.join(str(p) for p in paths[:4])}"
                f"{' ...' if len(paths) > 4 else ''}) hold only {covered} of the {total} elements of '{fqn}': "
                f"give the slices of every rank that saved it"
            )
