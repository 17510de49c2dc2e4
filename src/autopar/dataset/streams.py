"""Index-domain stages: the order in which source rows (and batches) appear in one epoch.

Map operations before ``batch`` are row-wise, so the order of the rows of an epoch can be computed from
indices alone, before any pixel is touched: source order -> shard -> every shuffle / repeat stage. Only then are
the rows of each batch gathered in one call and transformed together. A stage is a *factory*
``f(path, seed) -> iterator``: ``path`` names the pass (``(epoch,)`` at the top, one more element per
enclosing ``repeat``) and, with the global seed captured when the epoch started, is the only input of every
random draw -- so any epoch can be
recomputed from scratch, which is what exact resume (``iter_epoch(epoch, start_step)``) needs.

Row-level streams yield int64 chunks of row indices (chunk sizes are arbitrary); batch-level streams yield
one int64 array per batch.
"""
from __future__ import annotations

import itertools
from typing import Callable, Iterator

import numpy as np

from autopar.dataset import _random
from autopar.errors import DatasetError

Factory = Callable[[tuple, int], Iterator[np.ndarray]]


def regroup(chunks: Iterator[np.ndarray], size: int, drop_remainder: bool) -> Iterator[np.ndarray]:
    """Re-cut a stream of index chunks into arrays of exactly ``size`` (the last one shorter unless dropped)."""
    carry = None
    for c in chunks:
        if carry is not None:
            need = size - len(carry)
            if len(c) < need:
                carry = np.concatenate([carry, c])
                continue
            yield np.concatenate([carry, c[:need]])
            c = c[need:]
            carry = None
        full = len(c) - len(c) % size
        for s in range(0, full, size):
            yield c[s:s + size]
        if full < len(c):
            carry = c[full:]
    if carry is not None and len(carry) and not drop_remainder:
        yield carry


def _shuffle_rows(chunks: Iterator[np.ndarray], buffer_size: int, rng: np.random.Generator):
    """MindSpore buffer shuffle over single rows: keep ``buffer_size`` rows, emit a random one, refill."""
    buf: list[int] = []
    for chunk in chunks:
        items = chunk.tolist()
        fill = min(len(items), buffer_size - len(buf))
        buf.extend(items[:fill])
        rest = items[fill:]
        if rest:
            out = []
            for j, item in zip(rng.integers(0, buffer_size, size=len(rest)).tolist(), rest):
                out.append(buf[j])
                buf[j] = item
            yield np.asarray(out, dtype=np.int64)
    if buf:
        yield np.asarray(buf, dtype=np.int64)[rng.permutation(len(buf))]


def _shuffle_items(items: Iterator[np.ndarray], buffer_size: int, rng: np.random.Generator):
    """The same buffer shuffle over whole batches."""
    buf: list = []
    for item in items:
        if len(buf) < buffer_size:
            buf.append(item)
            continue
        j = int(rng.integers(0, buffer_size))
        yield buf[j]
        buf[j] = item
    for j in rng.permutation(len(buf)).tolist():
        yield buf[j]


def source_stage(sampler) -> Factory:
    def stage(path, seed):
        yield sampler.indices(path, seed)
    return stage


def shuffle_stage(inner: Factory, buffer_size: int, position: int, shard_id: int, rows: bool) -> Factory:
    def stage(path, seed):
        rng = _random.generator(seed, _random.TAG_SHUFFLE, position, shard_id, len(path), *path)
        fn = _shuffle_rows if rows else _shuffle_items
        return fn(inner(path, seed), buffer_size, rng)
    return stage


def repeat_stage(inner: Factory, count: int | None) -> Factory:
    def stage(path, seed):
        for r in (itertools.count() if count is None else range(count)):
            produced = False
            for item in inner(path + (r,), seed):
                produced = True
                yield item
            if not produced and count is None:
                raise DatasetError("repeat: the repeated pipeline produced no data, so repeating it forever would "
                                   "never yield anything (check batch_size / drop_remainder against the shard size)")
    return stage


def batch_stage(inner: Factory, batch_size: int, drop_remainder: bool) -> Factory:
    def stage(path, seed):
        return regroup(inner(path, seed), batch_size, drop_remainder)
    return stage


def take_stage(inner: Factory, count: int, rows: bool) -> Factory:
    """The first ``count`` items of each epoch: rows (before ``batch``) or batches (after)."""
    def stage(path, seed):
        if not rows:
            yield from itertools.islice(inner(path, seed), count)
            return
        left = count
        for chunk in inner(path, seed):
            if left <= 0:
                return
            yield chunk[:left]
            left -= len(chunk[:left])
    return stage
