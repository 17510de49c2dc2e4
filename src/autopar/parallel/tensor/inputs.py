"""How a batch enters the layout world: the ``dataset_strategy`` of ``set_auto_parallel_context``.

Each entry says, per input dimension, into how many parts the *global* batch is split over the devices; a rank
loads its slice (:func:`dataset_shard`), and :func:`dataset_input` declares that slice a DTensor of the global shape.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from autopar.comm.topology import world_mesh, world_size
from autopar.errors import StrategyError, warn_once
from autopar.layout.layout import Layout


def dataset_layout(entry: Any, local_shape: tuple[int, ...]) -> Layout:
    """The layout of a network input under a ``dataset_strategy`` entry (one split count per dimension; devices
    beyond the product replicate, first axis, as for operator strategies). ``local_shape`` is what this rank
    loaded: its slice."""
    entry = tuple(int(v) for v in entry)
    if len(entry) != len(local_shape):
        raise StrategyError(f"dataset_strategy entry {entry} has {len(entry)} values but the input has rank "
                            f"{len(local_shape)} (local shape {local_shape})")
    n = world_size()
    product = math.prod(entry)
    if product > n or n % product:
        raise StrategyError(f"dataset_strategy entry {entry} does not divide the {n} devices")
    return _entry_layout(entry, tuple(s * v for s, v in zip(local_shape, entry)))


def _entry_layout(entry: tuple[int, ...], full_shape: tuple[int, ...]) -> Layout:
    """The layout of a tensor of ``full_shape`` split as ``entry`` says, the devices beyond the splits' product
    replicas on the first axis."""
    split_dims = [d for d, v in enumerate(entry) if v > 1]
    matrix = (world_size() // math.prod(entry),) + tuple(entry[d] for d in split_dims)
    tmap = tuple(split_dims.index(d) + 1 if d in split_dims else -1 for d in range(len(entry)))
    return Layout(matrix, tmap, full_shape)


def sequence_slice(t: DTensor, strategy: Any) -> torch.Tensor | None:
    """A network output split on its sequence, as this rank loaded its inputs when ``dataset_strategy`` splits their
    sequence (context parallelism): its rows and its slice of the sequence -- as Megatron-LM and torch's
    ``context_parallel`` hand outputs back. The logits of a long sequence are never whole on a rank (gathered, the
    sequence x vocabulary tensor alone outgrew what the split saved). None where the strategy splits no sequence or
    the output does not follow the split (a pooled output, a loss): it comes back as data parallel's."""
    entry = next((tuple(int(v) for v in e) for e in (strategy if isinstance(strategy, (tuple, list)) else ())
                  if isinstance(e, (tuple, list)) and len(e) > 1 and int(e[1]) > 1), None)
    if entry is None or t.dim() < 2:
        return None
    entry = entry[:2] + (1,) * (t.dim() - 2)
    if t.shape[0] % entry[0] or t.shape[1] % entry[1]:
        return None
    placements = _entry_layout(entry, tuple(t.shape)).placements()
    # following the slices: dimension 1 split on the axes the sequence was loaded over (not features or heads split
    # on other ranks' axes, which a pooled or head-split output has there)
    if not all(getattr(have, "dim", None) == 1 for have, want in zip(t.placements, placements)
               if isinstance(want, Shard) and want.dim == 1):
        return None
    sliced = (t if tuple(t.placements) == tuple(placements) else t.redistribute(world_mesh(), placements)).to_local()
    warn_once("sequence_slice", f"context parallelism: the network's outputs split on the sequence come back "
              f"as this rank's slice of it, as it loaded its inputs (shape {tuple(sliced.shape)} of "
              f"{tuple(t.shape)}): a loss inside the network is the whole sequence's; gather them "
              "(torch.distributed.all_gather) where the whole is needed")
    return sliced


def resplit_sequence(batch: DTensor, cp: int) -> DTensor:
    """A batch as data parallel loads it (rows split, or whole) re-split as ``dataset_strategy=((n/cp, cp), ...)``
    would have loaded it: rows over ``n/cp`` ranks, the sequence (dimension 1) over ``cp`` -- AUTO's context
    parallelism, where the user's loader stays as it is. A tensor without a sequence has its rows over the ``n/cp``
    data-parallel ranks, whole over the ``cp`` ranks of each."""
    n = world_size()
    entry = (n // cp, cp) + (1,) * (batch.dim() - 2) if batch.dim() >= 2 else (n // cp,) * batch.dim()
    placements = _entry_layout(entry, tuple(batch.shape)).placements()
    return batch if tuple(batch.placements) == tuple(placements) else batch.redistribute(world_mesh(), placements)


def dataset_input(local: torch.Tensor, entry: Any) -> DTensor:
    layout = dataset_layout(entry, tuple(local.shape))
    return DTensor.from_local(local, world_mesh(), layout.placements(), run_check=False,
                              shape=torch.Size(layout.full_shape), stride=_contiguous_strides(layout.full_shape))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def splits_sequence(strategy: Any) -> bool:
    """Does a ``dataset_strategy`` split its inputs' dimension 1 (the sequence)? Context parallelism."""
    entries = strategy if isinstance(strategy, (tuple, list)) else ()
    return any(isinstance(e, (tuple, list)) and len(e) > 1 and int(e[1]) > 1 for e in entries)


def dataset_shard(entry: Any, rank: int | None = None) -> tuple[int, int]:
    """(num_shards, shard_id) a rank should load along dimension 0 under a dataset_strategy entry."""
    rank = dist.get_rank() if rank is None else rank
    parts = int(entry[0])
    layout = Layout((world_size() // parts, parts) if parts > 1 else (world_size(),),
                    (1,) if parts > 1 else (-1,), (parts,))
    return parts, layout.slice_index(rank)[0]
