"""The PyTorch door to shard strategies: ``autopar.shard(module, strategy)`` for ``nn.Linear`` and ``nn.Conv2d``.

The module keeps its parameters and its state_dict; it gains a hidden operator (``_autopar_op``) whose dimension
labels say what a strategy means for it, and its class becomes a subclass whose ``forward`` calls that operator
with the module's parameters. Outside a parallel runtime the operator computes exactly the module's own forward.

- ``nn.Linear``: strategy ``((a, b), (c, b))`` for (input, weight) -- MindSpore's ``Dense`` convention (weight is
  (out, in)): ``((1, 1), (2, 1))`` splits the output features (Megatron column), ``((1, 2), (1, 2))`` the input
  features (row: partial sums). The bias follows the output features.
- ``nn.Conv2d``: ``((n, c, 1, 1), (o, c, 1, 1))``: batch, input channels (partial sums), output channels.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from autopar.errors import StrategyError
from autopar.layout import spec as S
from autopar.ops.math import ShardablePrimitive


class LinearOp(ShardablePrimitive):
    bias_index = 2  # when the contraction is split, each part adds 1/k of the bias (see SemiAutoRuntime.run_op)

    def spec(self, x, weight, bias=None) -> S.OpSpec:
        batch = "abcdefgh"[: x.dim() - 1]
        inputs = (batch + "k", "jk") + (("j",) if bias is not None else ())
        return S.OpSpec(inputs, batch + "j")

    def compute(self, x, weight, bias=None):
        return F.linear(x, weight, bias)


class Conv2dOp(ShardablePrimitive):
    bias_index = 2

    def __init__(self, conv_forward, groups: int):
        super().__init__()
        self.__dict__["_conv_forward"] = conv_forward  # a bound method, not a submodule (no module cycle)
        self.groups = groups

    def spec(self, x, weight, bias=None) -> S.OpSpec:
        inputs = ("nchw", "ocyx") + (("o",) if bias is not None else ())
        fixed = "hwyx" + ("co" if self.groups != 1 else "")
        return S.OpSpec(inputs, "nohw", unsplittable=frozenset(fixed))

    def compute(self, x, weight, bias=None):
        return self._conv_forward(x, weight, bias)


class _Sharded:
    """Mixin: forward through the module's ``_autopar_op``."""

    def forward(self, x):  # type: ignore[override]
        if self.bias is not None:
            return self._autopar_op(x, self.weight, self.bias)
        return self._autopar_op(x, self.weight)


_SHARDED_CLASSES: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    if cls not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[cls] = type(f"Sharded{cls.__name__}", (_Sharded, cls), {"__module__": cls.__module__})
    return _SHARDED_CLASSES[cls]


def _with_bias_entry(strategy: Any, bias_split: int, has_bias: bool) -> tuple:
    strategy = tuple(tuple(s) for s in strategy)
    if has_bias and len(strategy) == 2:
        strategy += ((bias_split,),)
    return strategy


def shard(module: Any, in_strategy: Any, out_strategy: Any = None) -> Any:
    """Give ``module`` a MindSpore shard strategy (an autopar operator, ``nn.Linear`` or ``nn.Conv2d``)."""
    if isinstance(module, ShardablePrimitive):
        return module.shard(in_strategy, out_strategy)
    if isinstance(module, _Sharded):
        base = module._autopar_op
    elif isinstance(module, torch.nn.Linear):
        base = LinearOp()
    elif isinstance(module, torch.nn.Conv2d):
        base = Conv2dOp(module._conv_forward, module.groups)
    else:
        raise StrategyError(f"autopar.shard cannot shard a {type(module).__name__}: supported are nn.Linear, "
                            f"nn.Conv2d and the autopar.ops operators")
    if not isinstance(in_strategy, (tuple, list)) or len(in_strategy) < 2:
        raise StrategyError(f"{type(module).__name__}: the strategy needs an entry for the input and the weight, "
                            f"got {in_strategy!r}")
    has_bias = module.bias is not None
    base.shard(_with_bias_entry(in_strategy, in_strategy[1][0], has_bias), out_strategy)
    if not isinstance(module, _Sharded):
        module._autopar_op = base
        module.__class__ = _sharded_class(type(module))
    return module


def has_strategies(*modules: torch.nn.Module | None) -> bool:
    """Does any operator or module carry a shard strategy?"""
    for root in modules:
        if not isinstance(root, torch.nn.Module):  # None, or a loss given as a function
            continue
        for m in root.modules():
            if getattr(m, "_autopar_op", None) is not None:
                return True
            if isinstance(m, ShardablePrimitive) and m.strategy is not None:
                return True
    return False
