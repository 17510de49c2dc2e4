"""``mindspore.nn.utils.no_init_parameters``: build a network without filling its parameters yet.

Inside ``with no_init_parameters():`` every tensor is made on torch's meta device (no memory) and how it was filled
is recorded (:mod:`autopar.common.deferred`, the same machinery as the PyTorch door's ``autopar.deferred_init``).
Under a parallel mode each rank then materialises only what it keeps, when the network is laid out (its first
call): ZeRO's shards, a layout's slices -- with the values an eager build would have drawn. Without one (or where
the mode keeps parameters whole) they are materialised whole -- in place, the same ``Parameter`` objects, so an
optimizer made inside the block keeps working -- at the first call of any module (:func:`materialize_pending` does
it by hand).
"""
from __future__ import annotations

from typing import Any

from autopar.common import deferred


class no_init_parameters:
    """``with no_init_parameters(): net = Network(); opt = nn.SGD(net.trainable_params(), 0.01)``."""

    def __enter__(self) -> "no_init_parameters":
        self._recording = deferred.recording()
        self._recording.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._recording.__exit__(*exc)


def materialize_pending() -> int:
    """Give every parameter and buffer made inside ``no_init_parameters`` (or ``deferred_init``) and not laid out
    yet its real values, whole; returns how many."""
    return deferred.materialize_pending()
