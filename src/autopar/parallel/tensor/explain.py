"""What DTensor's refusals mean for the user's network, in one line (registered with :func:`autopar.errors.
explained_by`, so an uncaught one prints that line -- and a dry run's verdict is that line).

A column split of a fused projection: timm's ViT computes q, k and v with one ``Linear`` whose output features are
(3, heads, head_dim) and reshapes them so. Split by columns over n ranks, a rank holds a contiguous 1/n of the
3 x heads x head_dim features -- across q, k and v, not a third of each -- and DTensor refuses the reshape
("Cannot unflatten unevenly sharded tensor ... Sharding propagation failed for aten.view.default(...)").
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
    return (f"{what}, and the split does not divide the first new dimension: a column split of a fused projection "
            "(q, k and v in one Linear, as timm's qkv) gives each rank features across q, k and v -- leave that "
            "projection whole and split the attention's output projection and the MLP, or give q, k and v "
            "projections of their own (columns each)")


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
