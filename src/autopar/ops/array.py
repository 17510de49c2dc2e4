"""MindSpore's array, comparison and debugging operators.

The shape helpers (``Flatten``, ``ExpandDims``, ``Concat`` ...) and ``Print`` are *local* operators: they run on
whatever tensors they get, DTensors included (torch's DTensor dispatch carries the layout through a reshape), so in
SEMI_AUTO_PARALLEL they neither take a strategy nor move data. Comparisons and logical operators are element-wise
and shardable like ``Add``. ``Gather`` is shardable on its table's columns and on the indices (not on the table's
rows: a row split needs masked lookups that are not implemented; such a strategy is refused with one line).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from autopar.errors import StrategyError
from autopar.layout import spec as S
from autopar.ops.math import ShardablePrimitive, _Binary, _Unary
from autopar.ops.primitive import Primitive


class _Local(Primitive):
    local = True


class Flatten(_Local):
    """``ops.Flatten()(x)``: ``(N, ...)`` -> ``(N, prod(...))``."""

    def compute(self, x):
        return x.reshape(x.shape[0], -1) if x.dim() > 1 else x.reshape(x.shape[0], 1)


class ExpandDims(_Local):
    def compute(self, x, axis: int):
        return x.unsqueeze(axis)


class Concat(_Local):
    def __init__(self, axis: int = 0):
        super().__init__()
        self.axis = axis

    def compute(self, tensors):
        return torch.cat(tuple(tensors), self.axis)


class Stack(_Local):
    def __init__(self, axis: int = 0):
        super().__init__()
        self.axis = axis

    def compute(self, tensors):
        return torch.stack(tuple(tensors), self.axis)


class Shape(_Local):
    def compute(self, x):
        return tuple(x.shape)


class DType(_Local):
    def compute(self, x):
        return x.dtype


class Fill(_Local):
    """``ops.Fill()(dtype, shape, value)``."""

    def compute(self, dtype, shape, value):
        return torch.full(tuple(shape), value, dtype=dtype)


class ZerosLike(_Local):
    def compute(self, x):
        return torch.zeros_like(x)


class OnesLike(_Local):
    def compute(self, x):
        return torch.ones_like(x)


class Select(_Local):
    """``ops.Select()(condition, x, y)``: ``x`` where ``condition``, else ``y``."""

    def compute(self, condition, x, y):
        return torch.where(condition, x, y)


class Dropout(_Local):
    """``ops.Dropout(keep_prob=0.5)(x)`` -> ``(output, mask)``: applied on every call (MindSpore's operator knows
    no training mode; ``nn.Dropout`` does)."""

    def __init__(self, keep_prob: float = 0.5, Seed0: int = 0, Seed1: int = 0):  # noqa: N803 - MindSpore's names
        super().__init__()
        if not 0.0 < keep_prob <= 1.0:
            raise ValueError(f"Dropout: keep_prob must be in (0, 1], got {keep_prob}")
        self.keep_prob = keep_prob

    def compute(self, x):
        mask = torch.bernoulli(torch.full_like(x, self.keep_prob))
        return x * mask / self.keep_prob, mask


class Assign(_Local):
    """``ops.Assign()(variable, value)``: writes ``value`` into the parameter, outside autograd."""

    def compute(self, variable, value):
        with torch.no_grad():
            variable.copy_(value)
        return variable


class AssignAdd(_Local):
    def compute(self, variable, value):
        with torch.no_grad():
            variable.add_(value)
        return variable


def _format(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        array = value.detach().cpu().numpy()
        dtype = str(value.dtype).replace("torch.", "").capitalize()
        return f"Tensor(shape={list(array.shape)}, dtype={dtype}, value=\n{np.array2string(array)})"
    return str(value)


class Print(_Local):
    """``ops.Print()("out is:", out)``: each argument on its own line, tensors as MindSpore prints them
    (``Tensor(shape=[2, 3], dtype=Float32, value=...)``); a sharded tensor is gathered whole first. Returns
    nothing useful (MindSpore returns a dummy scalar)."""

    def compute(self, *inputs):
        if torch.compiler.is_exporting():  # a pipeline's split traces the network: the stages keep tensor work only
            return torch.zeros((), dtype=torch.int32)  # (the runner warns that such a Print prints nothing)
        print("\n".join(_format(v) for v in inputs), flush=True)
        return torch.tensor(0, dtype=torch.int32)


# -------------------------------------------------------------------------------------- element-wise, shardable
class NotEqual(_Binary):
    fn = staticmethod(torch.ne)


class Equal(_Binary):
    fn = staticmethod(torch.eq)


class Less(_Binary):
    fn = staticmethod(torch.lt)


class LessEqual(_Binary):
    fn = staticmethod(torch.le)


class Greater(_Binary):
    fn = staticmethod(torch.gt)


class GreaterEqual(_Binary):
    fn = staticmethod(torch.ge)


class LogicalOr(_Binary):
    fn = staticmethod(torch.logical_or)


class LogicalAnd(_Binary):
    fn = staticmethod(torch.logical_and)


class Pow(_Binary):
    fn = staticmethod(torch.pow)


class LogicalNot(_Unary):
    fn = staticmethod(torch.logical_not)


class Abs(_Unary):
    fn = staticmethod(torch.abs)


class Erf(_Unary):
    fn = staticmethod(torch.erf)


class Gather(ShardablePrimitive):
    """``ops.Gather()(params, indices, axis)``: rows of ``params`` (axis 0) picked by ``indices``."""

    def spec(self, params, indices, axis=0) -> S.OpSpec:
        if axis != 0 or params.dim() != 2:
            raise StrategyError(f"{self.name}: only axis 0 of a 2-D table is supported, got axis {axis} of "
                                f"{params.dim()}-D")
        idx = "nopqrs"[: indices.dim()]
        return S.OpSpec(("vh", idx), idx + "h", unsplittable=frozenset("v"))

    def compute(self, params, indices, axis=0):
        return torch.index_select(params, axis, indices.reshape(-1).long()).reshape(
            tuple(indices.shape) + tuple(params.shape[:axis]) + tuple(params.shape[axis + 1:]))
