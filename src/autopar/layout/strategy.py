"""From a MindSpore shard strategy to Layouts: validation, device matrix, input layouts, output layout.

A strategy has one tuple per tensor input; entry d of input i is the number of parts of dimension d. Through the
operator's dimension labels (:mod:`autopar.layout.spec`) every label gets one split count; the device matrix is
``(repeat,) + (split of each split label, in order of first appearance)``, where ``repeat`` = devices / product
of the splits is the data-parallel (replica) axis, first as in MindSpore. Every error names the operator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from autopar.errors import StrategyError
from autopar.layout.layout import Layout
from autopar.layout.spec import OpSpec


@dataclass(frozen=True)
class OpPlan:
    """How one call of an operator is laid out."""

    device_matrix: tuple[int, ...]
    label_axis: tuple[tuple[str, int], ...]  # split label -> device-matrix axis
    inputs: tuple[Layout, ...]
    output_map: tuple[int, ...]  # device-matrix axis of each output dimension (-1: not split)
    partial_axes: tuple[int, ...]  # device-matrix axes over which the output is a partial result
    reduction: str
    strategy: tuple[tuple[int, ...], ...]
    input_labels: tuple[str, ...] = ()  # each input's labels, broadcast (size-1) dimensions as "1"

    def absent_axes(self, input_index: int) -> tuple[int, ...]:
        """Device-matrix axes of split labels that input ``input_index`` does not have (or only broadcasts): its
        gradient is a partial sum over them (those devices computed different parts of the output from the same
        input)."""
        labels = self.input_labels[input_index]
        return tuple(axis for label, axis in self.label_axis if label not in labels)


def data_parallel_strategy(spec: OpSpec, shapes: list[tuple[int, ...]], device_num: int) -> tuple:
    """MindSpore's default for an operator without a strategy: the first dimension of the first input (and that
    same dimension wherever it appears) split over every device -- or nothing split when it does not divide."""
    label = spec.inputs[0][0] if spec.inputs and spec.inputs[0] else None
    dims = [shape[d] for labels, shape in zip(spec.inputs, shapes) for d, c in enumerate(labels) if c == label]
    if device_num == 1 or label is None or label in spec.unsplittable or any(n % device_num for n in dims):
        label = None
    return tuple(tuple(device_num if c == label else 1 for c in labels) for labels in spec.inputs)


def _fmt(strategy) -> str:
    return str(tuple(tuple(s) for s in strategy))


@lru_cache(maxsize=4096)
def derive_plan(op: str, spec: OpSpec, strategy: tuple, shapes: tuple, device_num: int) -> OpPlan:
    """Check ``strategy`` for an operator called on tensors of ``shapes`` and lay it out on ``device_num`` devices."""
    n = len(spec.inputs)
    if len(strategy) != n:
        raise StrategyError(f"{op}: strategy {_fmt(strategy)} has {len(strategy)} entries but the operator has {n} "
                            f"tensor inputs")
    splits: dict[str, tuple[int, int, int]] = {}  # label -> (split, input, dim)
    for i, (labels, entry, shape) in enumerate(zip(spec.inputs, strategy, shapes)):
        if len(entry) != len(labels):
            raise StrategyError(f"{op}: strategy entry {tuple(entry)} for input {i} has {len(entry)} values but that "
                                f"input has rank {len(labels)} (shape {tuple(shape)})")
        for d, (label, split) in enumerate(zip(labels, entry)):
            size = shape[d] if d < len(shape) else 1
            if split > 1 and size == 1:
                raise StrategyError(f"{op}: dimension {d} of input {i} is broadcast (size 1) and cannot be split")
            if split > 1 and size % split:
                raise StrategyError(f"{op}: dimension {d} of input {i} has size {size}, which cannot be split into "
                                    f"{split} parts (strategy {_fmt(strategy)})")
            if size == 1 and split == 1 and len(shape) == len(labels):
                continue  # a broadcast dimension: whole, whatever the other inputs do with this label
            if label in splits and splits[label][0] != split:
                prev, pi, pd = splits[label]
                what = "contracted dimensions are" if label in spec.reduced else "the same dimension is"
                raise StrategyError(f"{op}: {what} split differently: input {pi} dimension {pd} into {prev} parts "
                                    f"but input {i} dimension {d} into {split} (strategy {_fmt(strategy)})")
            if label in spec.unsplittable and split > 1:
                raise StrategyError(f"{op}: dimension {d} of input {i} cannot be split (strategy {_fmt(strategy)})")
            splits.setdefault(label, (split, i, d))
    split_labels = [(label, s[0]) for label, s in splits.items() if s[0] > 1]
    product = math.prod(s for _, s in split_labels)
    if product > device_num:
        raise StrategyError(f"{op}: strategy {_fmt(strategy)} needs {product} devices but there are only {device_num}")
    if device_num % product:
        raise StrategyError(f"{op}: strategy {_fmt(strategy)} splits into {product} parts, which does not divide "
                            f"the {device_num} devices")
    matrix = (device_num // product,) + tuple(s for _, s in split_labels)
    label_axis = {label: k + 1 for k, (label, _) in enumerate(split_labels)}
    inputs = tuple(Layout(matrix, tuple(label_axis.get(c, -1) if d < len(shape) and shape[d] != 1 else -1
                                        for d, c in enumerate(labels)), tuple(shape[: len(labels)]))
                   for labels, shape in zip(spec.inputs, shapes))
    output_map = tuple(label_axis.get(c, -1) for c in spec.output)
    partial = tuple(label_axis[c] for c in sorted(spec.reduced) if c in label_axis)
    effective = tuple("".join(c if d < len(shape) and shape[d] != 1 else "1" for d, c in enumerate(labels))
                      for labels, shape in zip(spec.inputs, shapes))
    return OpPlan(matrix, tuple(label_axis.items()), inputs, output_map, partial, spec.reduction,
                  tuple(tuple(e) for e in strategy), effective)
