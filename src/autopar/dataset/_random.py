"""Where every random number of the data pipeline comes from.

Each random decision draws from a fresh numpy Generator keyed by *what* is being decided (a tag), the global
seed and the *position* of the decision (epoch path, shard, step) -- never from a generator that carries state
from one batch to the next. That is what makes ``iter_epoch(e, start_step=k)`` reproduce exactly the tail of a
full epoch: batch k gets the same numbers whether or not batches 0..k-1 were computed, and whether a
prefetch thread ran ahead or not.
"""
from __future__ import annotations

import numpy as np

TAG_SAMPLER = 1  # global index order of a source (identical on every shard)
TAG_SHUFFLE = 2  # buffer shuffle stages (per shard)
TAG_TRANSFORM = 3  # random transforms of one batch / chunk
TAG_EAGER = 4  # transforms called directly by the user, outside a pipeline


def generator(seed: int, *key: int) -> np.random.Generator:
    """A Generator determined only by ``seed`` (the global seed, captured when an epoch starts) and ``key``
    (non-negative ints)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *key])))


_eager: list = [None]
DEFAULT_SEED = 0  # config's default seed; config tells this module of every later one (it imports this module,
# never the other way round)


def eager_rng() -> np.random.Generator:
    """The generator used when a random transform is called directly (``op(image)``)."""
    if _eager[0] is None:
        _eager[0] = generator(DEFAULT_SEED, TAG_EAGER)
    return _eager[0]


def reset_eager_rng(seed: int) -> None:
    """Called by ``config.set_seed`` so eager calls restart from the new seed."""
    _eager[0] = generator(seed, TAG_EAGER)
