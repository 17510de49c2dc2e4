"""What DTensor's refusals mean for the user's network, in one line (registered with :func:`autopar.errors.
explained_by`, so an uncaught one prints that line -- and a dry run's verdict is that line).

A split dimension reshaped into more dimensions, the first of which the ranks that split it do not divide: a column
split of timm's fused qkv (outputs reshaped to (3, heads, head_dim), cut into q, k and v by
:mod:`.fused_split`) over more ranks than divide the heads, or any view of a split dimension that unflattens it
unevenly -- DTensor refuses it deep in its sharding propagation ("Cannot unflatten unevenly sharded tensor ...
Sharding propagation failed for aten.view.default(...)").

A split that cuts inside the dimensions a view makes, which DTensor lets through and the rank's own view then refuses
("shape '[4, 8, 1, 8]' is invalid for input of size 128"): grouped-query attention's k and v projections split by
columns over more ranks than their key/value heads (:func:`split_heads_view`).
"""
from __future__ import annotations

import re

_UNFLATTEN = re.compile(r"Cannot unflatten unevenly sharded tensor")
_VIEW = re.compile(r"Sharding propagation failed for aten\.(?:view|reshape|_unsafe_view)\.default\(Spec\(\w+"
                   r"\[([\d, ]+)\]\((.*?)\)\), \[([-\d, ]+)\]")


def fused_projection_split(exc: BaseException) -> str | None:
    text = "\n".join(f"{e}\n" + "\n".join(getattr(e, "__notes__", ())) for e in _chain(exc))
    if not _UNFLATTEN.search(text):
        return None
    view = _VIEW.search(text)
    dim = re.search(r"S\((\d+)\)", view[2]) if view else None
    what = f"a [{view[1]}] tensor split on its dimension {dim[1] if dim else '?'} ({view[2]}) is reshaped to " \
        f"[{view[3]}]" if view else "a tensor split on its last dimension is reshaped into more dimensions"
    parts = ""
    if view:  # the split dimension unflattened: the new shape agrees with the old one before it
        old, shape = ([int(d) for d in text.split(",")] for text in (view[1], view[3]))
        at = next((int(d) for d in re.findall(r"S\((\d+)\)", view[2])
                   if int(d) < min(len(old), len(shape)) and shape[:int(d)] == old[:int(d)]
                   and shape[int(d)] != old[int(d)]), None)
        parts = f" ({shape[at]})" if at is not None else ""
    return (f"{what}, and the ranks that split it do not divide the first new dimension{parts}: tensor-parallel "
            "attention splits the heads (a fused q, k, v projection's too) -- split it over a number of ranks that "
            "divides them, or leave that projection whole and split the attention's output projection and the MLP")


_LOCAL_VIEW = re.compile(r"shape '\[([-\d, ]+)\]' is invalid for input of size (\d+)")


def split_heads_view(exc: BaseException) -> str | None:
    """A view DTensor let through whose local shape each rank's slice cannot take: a column split that cuts inside
    a head -- grouped-query attention's k and v projections (a Mixtral's or Llama's 2 key/value heads over 4 ranks)
    split over more ranks than their heads -- which DTensor propagates and the local view then refuses."""
    for e in _chain(exc):
        found = _LOCAL_VIEW.search(str(e))
        if found and isinstance(e, RuntimeError) and _raised_in_dtensor(e):
            # (the same line on every rank: the shape each asks for differs, 1 or 0 of a head)
            return ("a view of a tensor split over the ranks asks the ranks' slices for shapes they cannot take: the "
                    "split cuts inside the new dimensions -- tensor-parallel attention splits the heads, grouped-query "
                    "attention's key/value heads too: split its projections over a number of ranks that divides the "
                    "key/value heads, or leave k and v whole")
    return None


def _raised_in_dtensor(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("torch/distributed/tensor/_dispatch.py"):
            return True
        tb = tb.tb_next
    return False


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
