"""Dimension labels of an operator: the one description from which strategies are checked and layouts derived.

Like an einsum: every tensor input gets one label per dimension, the output gets labels, and a label that appears
in an input but not in the output is *reduced* (contracted in MatMul, summed in ReduceSum...). A shard strategy
gives a split count per input dimension, hence per label; the same label must be split the same way wherever it
appears (MindSpore's "contracted dimensions split differently" error), a reduced label that is split produces a
partial result (reduced by the op's reduction: sum, max, min or mean), and some labels may not be split at all
(the softmax axis).
"""
from __future__ import annotations

import string
from dataclasses import dataclass, field

LETTERS = string.ascii_lowercase


@dataclass(frozen=True)
class OpSpec:
    inputs: tuple[str, ...]  # labels of each *tensor* input (the strategy has one tuple per entry)
    output: str  # labels of the output ("" for a scalar); "1" marks a kept size-1 dimension (keep_dims)
    reduction: str = "sum"  # how a split reduced label combines: sum | max | min | avg
    unsplittable: frozenset[str] = field(default_factory=frozenset)

    @property
    def reduced(self) -> set[str]:
        out = set(self.output)
        return {label for labels in self.inputs for label in labels if label not in out}


def elementwise(*ranks: int) -> OpSpec:
    """Broadcasting element-wise op: dims aligned on the right share labels."""
    n = max(ranks)
    out = LETTERS[:n]
    return OpSpec(tuple(out[n - r:] for r in ranks), out)


def reduction(rank: int, axes: tuple[int, ...], keep_dims: bool, kind: str) -> OpSpec:
    labels = LETTERS[:rank]
    axes = tuple(sorted(a % rank for a in axes)) if axes else tuple(range(rank))
    out = "".join(("1" if keep_dims else "") if i in axes else c for i, c in enumerate(labels))
    return OpSpec((labels,), out, reduction=kind)


def matmul(rank_a: int, rank_b: int, transpose_a: bool = False, transpose_b: bool = False) -> OpSpec:
    """(..., i, k) @ (..., k, j) -> (..., i, j) with broadcast batch dims (labels n, o, p ... for batch)."""
    nb = max(rank_a, rank_b) - 2
    batch = "nopqrs"[:nb]
    a = batch[nb - (rank_a - 2):] + ("ki" if transpose_a else "ik")
    b = batch[nb - (rank_b - 2):] + ("jk" if transpose_b else "kj")
    return OpSpec((a, b), batch + "ij")
