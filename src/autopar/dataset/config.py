"""Global settings of the data pipeline (``autopar.dataset.config``), MindSpore style.

Why a module of functions rather than arguments: the MindSpore API sets these process-wide
(``ds.config.set_seed(1)``) and every pipeline reads them when an iteration *starts*, so a seed set after the
pipeline was built still applies. The default seed is a constant (0), not time based, so every process of a
data-parallel job derives the same global shuffle order and the shards stay disjoint without any communication.
"""
from __future__ import annotations

from autopar.dataset import _random
from autopar.errors import DatasetError

_MAX_SEED = 2**32 - 1

_state = {"seed": _random.DEFAULT_SEED, "prefetch_size": 2, "num_parallel_workers": 1}


def _check_int(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DatasetError(f"config.{name}: expected an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise DatasetError(f"config.{name}: {value} is out of range, expected {bound}")
    return value


def set_seed(seed: int) -> None:
    """Set the global seed of every shuffle and random transform (0 .. 2**32-1); the same on every process."""
    _state["seed"] = _check_int("set_seed", seed, 0, _MAX_SEED)
    # Eager (user-called) random transforms draw from a module generator; re-seed it too.
    _random.reset_eager_rng(seed)


def get_seed() -> int:
    """The global seed (default 0)."""
    return _state["seed"]


def set_prefetch_size(size: int) -> None:
    """Number of ready batches a background thread keeps ahead of the consumer; 0 computes in the caller."""
    _state["prefetch_size"] = _check_int("set_prefetch_size", size, 0)


def get_prefetch_size() -> int:
    """Current prefetch depth (default 2)."""
    return _state["prefetch_size"]


def set_num_parallel_workers(num: int) -> None:
    """Accepted for MindSpore compatibility. Transforms run vectorised on whole batches in one producer thread,
    so the value is recorded but does not change execution."""
    _state["num_parallel_workers"] = _check_int("set_num_parallel_workers", num, 1)


def get_num_parallel_workers() -> int:
    """The value given to :func:`set_num_parallel_workers` (default 1)."""
    return _state["num_parallel_workers"]
