"""Which memory a tensor lies in, for tensors with storage and for the fake tensors of a dry run alike.

Why: the engines ask "is ``.grad`` already the bucket's view?" and "is this saved tensor the gathered weight?" by
address; a fake tensor (``autopar launch --dry-run``) has no address -- every one reads 0 -- so by address they all
look alike and the dry run would skip the copies a real run makes. A fake tensor's storage object is its identity.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake


def storage_id(t: torch.Tensor):
    """The identity of the storage ``t`` lies in (its address; a fake tensor's storage object)."""
    st = t.untyped_storage()
    return ("fake", st._cdata) if is_fake(t) else st.data_ptr()


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` start at the same element of the same memory (``a.data_ptr() == b.data_ptr()``)."""
    if is_fake(a) or is_fake(b):
        return storage_id(a) == storage_id(b) and a.storage_offset() == b.storage_offset()
    return a.data_ptr() == b.data_ptr()
