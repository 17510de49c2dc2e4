"""``autopar.set_seed`` (MindSpore's ``mindspore.set_seed``): one seed for every random number a job draws.

It seeds Python's ``random``, numpy's global generator, torch's (the initializers and ``nn.Dropout`` draw from it)
and the data pipeline (``autopar.dataset.config.set_seed``: shuffles and random transforms). Every rank of a
data-parallel job given the same seed builds the same initial weights and the same global shuffle, so the shards
stay disjoint and the replicas equal without ``parameter_broadcast``.
"""
from __future__ import annotations

import random

import numpy as np
import torch

from autopar.errors import ConfigError

_seed: list = [None]


def set_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"set_seed: the seed must be an integer, got {seed!r}")
    if not 0 <= seed < 2**32:
        raise ConfigError(f"set_seed: the seed must be in [0, 2**32), got {seed}")
    from autopar.dataset import config

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    config.set_seed(seed)
    _seed[0] = seed


def get_seed() -> int | None:
    """The seed given to :func:`set_seed` (None when it was never called)."""
    return _seed[0]
