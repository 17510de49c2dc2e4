"""ZeRO level 3 in the layout modes: a parameter gathered for an operator is not kept alive until the backward.

The layout runtime gathers a ZeRO-stored parameter (split over the data-parallel axes) to its operator's layout
for each use. Autograd would keep that whole copy until the backward, because the operator saves it -- which is
what levels 1 and 2 do (FSDP2's ``reshard_after_forward=False``). Level 3 frees it after the forward and gathers it
again when the backward unpacks it: ``torch.autograd.graph.saved_tensors_hooks`` replace a saved tensor that lives
in a gathered parameter's storage by a note (which parameter, which layout, which view) -- one more all-gather per
use, as FSDP2's level 3.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from autopar.parallel.memory_id import storage_id


class Regather(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self):
        # (storage address, device, stored param, placements) -- never the whole copy itself: autograd keeps the
        # pack hook (and so this object) with every tensor it saved, which would keep the copies alive
        self.gathered: list[tuple[object, torch.device, DTensor, tuple]] = []
        super().__init__(self._pack, self._unpack)

    def add(self, local: torch.Tensor, stored: DTensor, placements: tuple, what: str | None = None) -> None:
        """``what``: an activation's operator -- its kept split is checked unchanged when the backward gathers it
        (autograd's own check on a saved tensor, which the note stands in for)."""
        self.gathered.append((storage_id(local), local.device, stored, tuple(placements), what))

    def _pack(self, t: torch.Tensor):
        if not t.is_floating_point():
            return t
        ptr = storage_id(t)
        for address, device, stored, placements, what in self.gathered:
            if address == ptr and device == t.device:
                return _Note(stored, placements, tuple(t.size()), tuple(t.stride()), t.storage_offset(), what,
                             version(stored) if what else None)
        return t

    @staticmethod
    def _unpack(saved):
        if not isinstance(saved, _Note):
            return saved
        if saved.version is not None and version(saved.stored) != saved.version:
            raise RuntimeError(f"autopar: sequence parallelism keeps the sequence-split input of {saved.what} for "
                               "its backward and gathers it again there, but it was changed in place after that "
                               "forward: make the change out of place (x = x * s, not x.mul_(s))")
        with torch.no_grad():
            whole = saved.stored.redistribute(saved.stored.device_mesh, saved.placements).to_local()
        return whole.as_strided(saved.size, saved.stride, saved.offset)


def version(t: torch.Tensor) -> int:
    """The version counter in-place operators bump (a DTensor's local tensor's)."""
    return t._local_tensor._version if isinstance(t, DTensor) else t._version


class _Note:
    __slots__ = ("stored", "placements", "size", "stride", "offset", "what", "version")

    def __init__(self, stored, placements, size, stride, offset, what=None, version=None):
        self.stored, self.placements, self.size, self.stride, self.offset = stored, placements, size, stride, offset
        self.what, self.version = what, version
