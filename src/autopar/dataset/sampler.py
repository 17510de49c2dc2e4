"""Which source rows a shard reads in one pass (MindSpore ``DistributedSampler`` semantics).

Every shard computes the *same* global order -- a permutation seeded only by (global seed, pass) when
shuffling -- pads it by wrapping around to a multiple of ``num_shards`` and takes positions
``shard_id, shard_id + num_shards, ...``. Hence every shard has exactly ``ceil(N / num_shards)`` rows (equal
step counts on all ranks: no rank waits forever in a collective for a peer that ran out of data), shards are
disjoint and cover the data exactly when ``num_shards`` divides N, and no communication is needed.
"""
from __future__ import annotations

import numpy as np

from autopar.dataset import _random
from autopar.errors import DatasetError


def _opt_int(value, name: str, where: str):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DatasetError(f"{where}: {name} must be an integer, got {value!r}")
    return int(value)


def no_custom_sampler(sampler, where: str) -> None:
    """MindSpore's ``sampler=`` objects are not supported: every dataset shards by the arguments below instead."""
    if sampler is not None:
        raise DatasetError(f"{where}: custom samplers are not supported; use shuffle, num_shards, shard_id and "
                           f"num_samples")


class ShardSampler:
    """Row order of one shard of a source of ``num_rows`` rows; see the module docstring."""

    def __init__(self, shuffle=None, num_shards=None, shard_id=None, num_samples=None, where: str = "dataset"):
        num_shards = _opt_int(num_shards, "num_shards", where)
        shard_id = _opt_int(shard_id, "shard_id", where)
        num_samples = _opt_int(num_samples, "num_samples", where)
        if (num_shards is None) != (shard_id is None):
            raise DatasetError(f"{where}: num_shards and shard_id must be given together "
                               f"(got num_shards={num_shards}, shard_id={shard_id})")
        if num_shards is not None:
            if num_shards < 1:
                raise DatasetError(f"{where}: num_shards must be >= 1, got {num_shards}")
            if not 0 <= shard_id < num_shards:
                raise DatasetError(f"{where}: shard_id must be in [0, {num_shards}), got {shard_id}")
        if num_samples is not None and num_samples < 1:
            raise DatasetError(f"{where}: num_samples must be >= 1, got {num_samples}")
        if shuffle is not None and not isinstance(shuffle, (bool, np.bool_)):
            raise DatasetError(f"{where}: shuffle must be True, False or None, got {shuffle!r}")
        self.where = where
        self.num_rows = 0
        self.shuffle = True if shuffle is None else bool(shuffle)
        self.num_shards = num_shards or 1
        self.shard_id = shard_id or 0
        self.num_samples = num_samples

    def bind(self, num_rows: int) -> "ShardSampler":
        """Attach the source size (arguments are validated before the source is opened)."""
        if num_rows < 1:
            raise DatasetError(f"{self.where}: the source has no rows")
        self.num_rows = int(num_rows)
        if self.num_shards > self.num_rows:
            # more shards than records: every shard still gets one row per pass (equal step counts on all ranks),
            # but the rows repeat across shards -- said once, with the numbers, instead of silently
            from autopar.errors import warn_once

            repeats = self.num_shards - self.num_rows
            warn_once(f"sampler.more_shards:{self.where}:{self.num_shards}:{self.num_rows}",
                      f"{self.where}: num_shards={self.num_shards} is more than its {self.num_rows} records: each "
                      f"shard sees 1 record per pass, and {repeats} of the {self.num_shards} shards see a copy of "
                      f"another shard's record (use at most {self.num_rows} shards, or more data)")
        return self

    def __len__(self) -> int:
        per_shard = -(-self.num_rows // self.num_shards)
        return per_shard if self.num_samples is None else min(per_shard, self.num_samples)

    def indices(self, path: tuple[int, ...], seed: int) -> np.ndarray:
        """Source row indices of this shard for the pass identified by ``path`` (int64, length ``len(self)``)."""
        n, s = self.num_rows, self.num_shards
        if self.shuffle:
            order = _random.generator(seed, _random.TAG_SAMPLER, len(path), *path).permutation(n)
        else:
            order = np.arange(n, dtype=np.int64)
        per_shard = -(-n // s)
        if per_shard * s != n:
            order = np.resize(order, per_shard * s)  # wrap around: repeats the first rows of the order
        mine = order[self.shard_id::s]
        return mine[: len(self)].astype(np.int64, copy=False)
