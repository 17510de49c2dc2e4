"""What DTensor's refusals mean for the user's network, in one line (registered with :func:`autopar.errors.
explained_by`, so an uncaught one prints that line -- and a dry run's verdict is that line).

A split dimension reshaped into more dimensions, the first of which the ranks that split it do not divide: a column
split of timm's fused qkv (outputs reshaped to (3, heads, head_dim), cut into q, k and v by
:mod:`.fused_split`) over more ranks than divide the heads, or any view of a split dimension that unflattens it
unevenly -- DTensor refuses it deep in its sharding propagation ("Cannot unflatten unevenly sharded tensor ...
Sharding propagation failed for aten.view.default(...)").
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


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
