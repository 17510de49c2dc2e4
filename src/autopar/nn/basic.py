"""MindSpore's parameter-free layers and containers, each a subclass of the torch module it is (``nn.ReLU`` is a
``torch.nn.ReLU``, so the layout runtime keeps passing any layout through it), with MindSpore's arguments:
``Flatten(start_dim=1, end_dim=-1)``, ``Dropout(keep_prob=0.5, p=None)`` (``p``, the drop probability, wins when
given; MindSpore 1.x wrote ``keep_prob``), ``GELU(approximate=True)`` (MindSpore's default is the tanh form),
``Softmax(axis=-1)``, ``LeakyReLU(alpha=0.2)``, ``SequentialCell`` (cells as arguments, a list or an OrderedDict)
and ``CellList``.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from autopar.errors import ConfigError
from autopar.nn.cell import Cell, torch_forward


class Flatten(Cell, torch.nn.Flatten):
    def __init__(self, start_dim: int = 1, end_dim: int = -1):
        torch.nn.Flatten.__init__(self, start_dim, end_dim)

    forward = construct = torch_forward(torch.nn.Flatten)


def _activation(torch_cls: type) -> type:
    """MindSpore's name for a torch activation without arguments: that module, and a Cell."""
    def __init__(self):
        torch_cls.__init__(self)

    run = torch_forward(torch_cls)
    return type(torch_cls.__name__, (Cell, torch_cls), {"__init__": __init__, "forward": run, "construct": run,
                                                        "__module__": __name__, "__doc__": f"``nn.{torch_cls.__name__}``"})


ReLU = _activation(torch.nn.ReLU)
ReLU6 = _activation(torch.nn.ReLU6)
Sigmoid = _activation(torch.nn.Sigmoid)
Tanh = _activation(torch.nn.Tanh)
SiLU = _activation(torch.nn.SiLU)


class GELU(Cell, torch.nn.GELU):
    def __init__(self, approximate: bool = True):
        torch.nn.GELU.__init__(self, "tanh" if approximate else "none")

    forward = construct = torch_forward(torch.nn.GELU)


class LeakyReLU(Cell, torch.nn.LeakyReLU):
    def __init__(self, alpha: float = 0.2):
        torch.nn.LeakyReLU.__init__(self, alpha)

    forward = construct = torch_forward(torch.nn.LeakyReLU)


class ELU(Cell, torch.nn.ELU):
    def __init__(self, alpha: float = 1.0):
        torch.nn.ELU.__init__(self, alpha)

    forward = construct = torch_forward(torch.nn.ELU)


class Softmax(Cell, torch.nn.Softmax):
    def __init__(self, axis: int = -1):
        torch.nn.Softmax.__init__(self, axis)

    forward = construct = torch_forward(torch.nn.Softmax)


class LogSoftmax(Cell, torch.nn.LogSoftmax):
    def __init__(self, axis: int = -1):
        torch.nn.LogSoftmax.__init__(self, axis)

    forward = construct = torch_forward(torch.nn.LogSoftmax)


class Identity(Cell, torch.nn.Identity):
    def __init__(self, *args: Any, **kwargs: Any):
        torch.nn.Identity.__init__(self)

    forward = construct = torch_forward(torch.nn.Identity)


class Dropout(Cell, torch.nn.Dropout):
    """``nn.Dropout(keep_prob=0.5, p=None)``: zeroes each element with probability ``p`` (``1 - keep_prob`` when
    ``p`` is not given) in training and scales the rest by ``1 / (1 - p)``; the identity in evaluation."""

    def __init__(self, keep_prob: float = 0.5, p: float | None = None, dtype: Any = None):
        drop = (1.0 - keep_prob) if p is None else p
        if not 0.0 <= drop < 1.0:
            raise ConfigError(f"Dropout: the drop probability must be in [0, 1), got {drop} "
                              f"(keep_prob={keep_prob}, p={p})")
        torch.nn.Dropout.__init__(self, drop)
        self.keep_prob = 1.0 - drop

    forward = construct = torch_forward(torch.nn.Dropout)

    @property
    def dropout(self) -> "_ElementwiseHint":
        """MindSpore 1.x shards the operator inside (``self.dropout.dropout.shard(((dp, 1),))``)."""
        return _ElementwiseHint("nn.Dropout.dropout")


class _ElementwiseHint:
    """The operator inside an element-wise MindSpore layer, kept for its ``shard``: the layer runs on whatever layout
    its input has (or data-parallel), which computes the same values, so the strategy is accepted and warned
    about once."""

    def __init__(self, name: str):
        self.name = name

    def shard(self, in_strategy: Any, out_strategy: Any = None) -> "_ElementwiseHint":
        from autopar.errors import warn_once

        warn_once(f"{self.name}.shard", f"{self.name}.shard(...) is accepted and not applied: the element-wise layer "
                  f"follows its input's layout")
        return self


class SequentialCell(Cell, torch.nn.Sequential):
    """``nn.SequentialCell(cell, cell, ...)``, ``SequentialCell([cells])`` or ``SequentialCell(OrderedDict)``."""

    def __init__(self, *args: Any):
        if len(args) == 1 and isinstance(args[0], (list, tuple)):
            args = tuple(args[0])
        if len(args) == 1 and isinstance(args[0], (dict, OrderedDict)):
            torch.nn.Sequential.__init__(self, OrderedDict(args[0]))
        else:
            torch.nn.Sequential.__init__(self, *args)

    forward = construct = torch_forward(torch.nn.Sequential)


class CellList(Cell, torch.nn.ModuleList):
    """``nn.CellList([cells])``: cells held in order (``append``, ``extend``, ``insert``, indexing)."""

    def __init__(self, args: Any = None, **kwargs: Any):
        torch.nn.ModuleList.__init__(self, args)

    def forward(self, *args: Any) -> Any:
        raise NotImplementedError("CellList is a container; call its cells")

    construct = forward


_ACTIVATIONS = {"relu": ReLU, "relu6": ReLU6, "gelu": GELU, "sigmoid": Sigmoid, "tanh": Tanh, "silu": SiLU,
                "swish": SiLU, "leakyrelu": LeakyReLU, "elu": ELU, "softmax": Softmax, "logsoftmax": LogSoftmax}


def get_activation(name: str, prim_name: str | None = None) -> torch.nn.Module | None:
    """``nn.get_activation("relu")``: a new activation cell by name (None for None)."""
    if name is None:
        return None
    cls = _ACTIVATIONS.get(str(name).replace("_", "").lower())
    if cls is None:
        raise ConfigError(f"get_activation: unknown activation {name!r}; known: {', '.join(sorted(_ACTIVATIONS))}")
    return cls()


def activation_of(activation: Any) -> Any:
    """A Dense's ``activation``: a name, a cell / operator (any callable), or None."""
    if activation is None or callable(activation):
        return activation
    if isinstance(activation, str):
        return get_activation(activation)
    raise ConfigError(f"activation must be a name, a Cell, an operator or None, got {activation!r}")
