"""The torch function mode active while a layout runtime whose inputs split the sequence runs a forward pass: each
``F.scaled_dot_product_attention`` of a query split on its sequence goes to the ``context_parallel_algo`` chosen
(:mod:`.context`'s all-gather or Ulysses form, :mod:`.ring`'s ring); a key-value cache's first concatenation
keeps the keys split (:func:`.context._beside_empty`); batch and sequence flattened together move onto a batch
split first (:func:`.context._batch_first`)."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from autopar.parallel.tensor.context import (
    _RESHAPES,
    _SDPA,
    _batch_first,
    _beside_empty,
    _sequence_axes,
    attention,
    ulysses,
)
from autopar.parallel.tensor.ring import ring


class SequenceAttention(TorchFunctionMode):
    def __init__(self, algo: str = "all_gather"):
        super().__init__()
        self.attend = {"ring": ring, "ulysses": ulysses}.get(algo, attention)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SDPA and args and isinstance(args[0], DTensor) and _sequence_axes(args[0]):
            return self.attend(*args, **kwargs)
        if func is torch.cat and args and "out" not in kwargs:
            alone = _beside_empty(args[0])
            if alone is not None:  # (cat's result is contiguous; so is this copy)
                return alone.clone(memory_format=torch.contiguous_format)
        if func in _RESHAPES and args and isinstance(args[0], DTensor):
            args = (_batch_first(func, args[0], args, kwargs), *args[1:])
        return func(*args, **kwargs)


def enter(algo: str = "all_gather") -> SequenceAttention:
    mode = SequenceAttention(algo)
    mode.__enter__()
    return mode
