"""MindSpore compute operators (``ops.MatMul()``, ``ops.ReduceSum(keep_dims=True)``, ...), each shardable.

``compute`` is plain torch, so an operator runs unchanged on tensors and on DTensors; ``spec(*args)`` gives its
dimension labels (:mod:`autopar.layout.spec`) for the parallel layer; ``shard(strategy)`` records a MindSpore
strategy after checking what can be checked without shapes (the rest is checked at the first call).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from autopar.errors import StrategyError
from autopar.layout import spec as S
from autopar.ops.primitive import Primitive


def _tensor_args(args: Sequence[Any]) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


class ShardablePrimitive(Primitive):
    """An operator whose inputs may be split by a strategy: one tuple of split counts per tensor input."""

    def shard(self, in_strategy: Any, out_strategy: Any = None) -> "ShardablePrimitive":
        if out_strategy is not None:
            raise StrategyError(f"{self.name}: out_strategy is not supported; give the input strategy only")
        if not isinstance(in_strategy, (tuple, list)) or not all(isinstance(s, (tuple, list)) for s in in_strategy):
            raise StrategyError(f"{self.name}: a strategy is a tuple of tuples (one per input), got {in_strategy!r}")
        parsed = tuple(tuple(s) for s in in_strategy)
        for entry in parsed:
            for v in entry:
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise StrategyError(f"{self.name}: split counts must be positive integers, got {in_strategy!r}")
        self.strategy = parsed
        return self

    def spec(self, *args: Any) -> S.OpSpec:
        """Labels of the tensor inputs and the output for these arguments."""
        return S.elementwise(*[t.dim() for t in _tensor_args(args)])


# --------------------------------------------------------------------------------------------- linear algebra
class MatMul(ShardablePrimitive):
    def __init__(self, transpose_a: bool = False, transpose_b: bool = False):
        super().__init__()
        self.transpose_a = transpose_a
        self.transpose_b = transpose_b

    def spec(self, a, b) -> S.OpSpec:
        if a.dim() != 2 or b.dim() != 2:
            raise StrategyError(f"{self.name}: inputs must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
        return S.matmul(2, 2, self.transpose_a, self.transpose_b)

    def compute(self, a, b):
        a = a.transpose(-1, -2) if self.transpose_a else a
        b = b.transpose(-1, -2) if self.transpose_b else b
        return torch.matmul(a, b)


class BatchMatMul(MatMul):
    def spec(self, a, b) -> S.OpSpec:
        if a.dim() < 3 or b.dim() < 2:
            raise StrategyError(f"{self.name}: needs a batch of matrices, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
        return S.matmul(a.dim(), b.dim(), self.transpose_a, self.transpose_b)


class FusedAttention(ShardablePrimitive):
    """Causal scaled-dot-product attention as one kernel (FlashAttention, torch's SDPA): the ``s x s`` scores are
    never stored -- the backward recomputes them from q, k, v and the per-row log-sum-exp.

    ``q`` is ``[batch, heads, g x s, d]`` against ``k`` of ``[batch, heads, s, d]`` and ``v`` of ``[batch, heads,
    s, e]`` (``e`` = ``d`` but in multi-head latent attention, whose queries and keys carry a rotary part the values
    do not): with grouped-query attention each key/value head serves ``g`` query heads stacked along the rows (row
    ``r`` is position ``r % s``). Batch and heads may be split; rows, keys and the head dimensions stay whole
    (splitting the keys is context parallelism, whose partial results need a log-sum-exp merge).

    ``window``: sliding-window attention, each query meeting only the ``window`` latest keys (Mistral's, GPT-OSS's
    every other layer) -- its kernel skips the blocks outside the band, so its work is :meth:`window_share` of the
    causal kernel's."""

    def __init__(self, window: int = 0):
        super().__init__()
        self.window = window

    def window_share(self, s: int) -> float:
        """The share of the causal ``s x s`` triangle's query-key pairs a sliding window of ``window`` keeps:
        ``sum(min(i, w) for i in 1..s)`` over ``s (s + 1) / 2``."""
        w = min(self.window, s) if self.window else s
        return (w * s - w * (w - 1) / 2) / (s * (s + 1) / 2)

    def spec(self, q, k, v) -> S.OpSpec:
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise StrategyError(f"{self.name}: q, k, v must be [batch, heads, rows, head_dim], got shapes "
                                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        return S.OpSpec(("noid", "nojd", "noje"), "noie", unsplittable=frozenset("ijde"))

    def compute(self, q, k, v):
        b, h, rows, d = q.shape
        s, e = k.shape[2], v.shape[3]
        g = rows // s
        q = q.reshape(b, h, g, s, d)
        k, v = k.unsqueeze(2).expand(b, h, g, s, d), v.unsqueeze(2).expand(b, h, g, s, e)
        if self.window and self.window < s:  # the band of the latest ``window`` keys, this one included
            i = torch.arange(s, device=q.device)
            band = (i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < self.window)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=band).reshape(b, h, rows, e)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).reshape(b, h, rows, e)


class BiasAdd(ShardablePrimitive):
    """x + bias along dimension 1 (channels, NCHW / NC)."""

    def spec(self, x, b) -> S.OpSpec:
        labels = S.LETTERS[: x.dim()]
        return S.OpSpec((labels, labels[1]), labels)

    def compute(self, x, b):
        shape = [1] * x.dim()
        shape[1] = -1
        return x + b.reshape(shape)


# ------------------------------------------------------------------------------------------------- element-wise
class _Binary(ShardablePrimitive):
    fn = staticmethod(torch.add)

    def compute(self, a, b):
        return self.fn(a, b)


class Add(_Binary):
    fn = staticmethod(torch.add)


class Sub(_Binary):
    fn = staticmethod(torch.sub)


class Mul(_Binary):
    fn = staticmethod(torch.mul)


class RealDiv(_Binary):
    fn = staticmethod(torch.true_divide)


class Div(RealDiv):
    pass


class Maximum(_Binary):
    fn = staticmethod(torch.maximum)


class Minimum(_Binary):
    fn = staticmethod(torch.minimum)


class _Unary(ShardablePrimitive):
    fn = staticmethod(torch.neg)

    def compute(self, x):
        return self.fn(x)


class Exp(_Unary):
    fn = staticmethod(torch.exp)


class Log(_Unary):
    fn = staticmethod(torch.log)


class Sqrt(_Unary):
    fn = staticmethod(torch.sqrt)


class Square(_Unary):
    fn = staticmethod(torch.square)


class Neg(_Unary):
    fn = staticmethod(torch.neg)


class ReLU(_Unary):
    fn = staticmethod(torch.relu)


class Tanh(_Unary):
    fn = staticmethod(torch.tanh)


class Sigmoid(_Unary):
    fn = staticmethod(torch.sigmoid)


class GeLU(_Unary):
    """MindSpore's GeLU is the tanh approximation."""

    @staticmethod
    def fn(x):
        return F.gelu(x, approximate="tanh")


GELU = GeLU


class Softmax(ShardablePrimitive):
    def __init__(self, axis: int | tuple[int, ...] = -1):
        super().__init__()
        self.axis = axis[0] if isinstance(axis, (tuple, list)) else axis

    def spec(self, x) -> S.OpSpec:
        labels = S.LETTERS[: x.dim()]
        return S.OpSpec((labels,), labels, unsplittable=frozenset(labels[self.axis % x.dim()]))

    def compute(self, x):
        return torch.softmax(x, dim=self.axis)


class LogSoftmax(Softmax):
    def compute(self, x):
        return torch.log_softmax(x, dim=self.axis)


# --------------------------------------------------------------------------------------------------- reductions
class _Reduce(ShardablePrimitive):
    kind = "sum"

    def __init__(self, keep_dims: bool = False):
        super().__init__()
        self.keep_dims = keep_dims

    @staticmethod
    def _axes(x, axis) -> tuple[int, ...]:
        if axis is None or axis == ():
            return tuple(range(x.dim()))
        return (axis,) if isinstance(axis, int) else tuple(axis)

    def spec(self, x, axis=()) -> S.OpSpec:
        return S.reduction(x.dim(), self._axes(x, axis), self.keep_dims, self.kind)

    def compute(self, x, axis=()):
        axes = self._axes(x, axis)
        return self._reduce(x, axes) if axes else x

    def _reduce(self, x, axes):  # pragma: no cover - abstract
        raise NotImplementedError


class ReduceSum(_Reduce):
    kind = "sum"

    def _reduce(self, x, axes):
        return torch.sum(x, dim=axes, keepdim=self.keep_dims)


class ReduceMean(_Reduce):
    kind = "avg"

    def _reduce(self, x, axes):
        return torch.mean(x, dim=axes, keepdim=self.keep_dims)


class ReduceMax(_Reduce):
    kind = "max"

    def _reduce(self, x, axes):
        return torch.amax(x, dim=axes, keepdim=self.keep_dims)


class ReduceMin(_Reduce):
    kind = "min"

    def _reduce(self, x, axes):
        return torch.amin(x, dim=axes, keepdim=self.keep_dims)


# ------------------------------------------------------------------------------------------------------- others
class OneHot(ShardablePrimitive):
    """``OneHot()(indices, depth, on_value, off_value)``; the strategy describes the output (MindSpore's rule):
    ``((batch_split, depth_split), (), ())``."""

    def __init__(self, axis: int = -1):
        super().__init__()
        if axis != -1:
            raise StrategyError("OneHot: only axis=-1 is supported")
        self.axis = axis

    def spec(self, indices, depth, on_value, off_value) -> S.OpSpec:
        out = S.LETTERS[: indices.dim() + 1]
        return S.OpSpec((out, "", ""), out)

    def compute(self, indices, depth, on_value, off_value):
        on = torch.as_tensor(on_value)
        off = torch.as_tensor(off_value)
        hot = F.one_hot(indices.long(), int(depth)).to(on.dtype)
        return hot * (on - off) + off


class Reshape(ShardablePrimitive):
    def spec(self, x, shape) -> S.OpSpec:
        labels = S.LETTERS[: x.dim()]
        return S.OpSpec((labels,), "")  # the output layout follows the input's (derived at run time)

    def compute(self, x, shape):
        return torch.reshape(x, tuple(shape))


class Transpose(ShardablePrimitive):
    def spec(self, x, perm) -> S.OpSpec:
        labels = S.LETTERS[: x.dim()]
        return S.OpSpec((labels,), "".join(labels[p] for p in perm))

    def compute(self, x, perm):
        return x.permute(*perm)


class Squeeze(ShardablePrimitive):
    def __init__(self, axis: int | tuple[int, ...] = ()):
        super().__init__()
        self.axis = (axis,) if isinstance(axis, int) else tuple(axis)

    def compute(self, x):
        return x.squeeze(self.axis) if self.axis else x.squeeze()


class Cast(Primitive):
    local = True  # a dtype change keeps any layout

    def compute(self, x, dtype):
        return x.to(dtype)


# ----------------------------------------------------------------------------------------- functional helpers
def shape(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.shape)


def scalar_to_array(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


scalar_to_tensor = scalar_to_array
