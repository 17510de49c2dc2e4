"""``autopar.Tensor`` and ``autopar.Parameter``: MindSpore's constructors, producing plain torch objects.

``Tensor(...)`` returns an ordinary ``torch.Tensor`` (so every torch function and DTensor accept it) and
``isinstance(x, autopar.Tensor)`` is true for any torch tensor. ``Parameter`` is a ``torch.nn.Parameter`` that also
carries MindSpore's ``name`` and ``layerwise_parallel`` flag (hybrid parallel: this rank holds a slice that the
data-parallel gradient all-reduce must skip).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch


class _TensorMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)


class Tensor(metaclass=_TensorMeta):
    """``Tensor(input_data, dtype=None)`` -> torch.Tensor (a copy, as MindSpore's constructor makes)."""

    def __new__(cls, input_data: Any = None, dtype: torch.dtype | None = None, shape: Any = None, init: Any = None):
        if input_data is None:
            if shape is None:
                raise ValueError("Tensor() needs input_data or a shape")
            return torch.zeros(tuple(shape) if not isinstance(shape, int) else (shape,), dtype=dtype or torch.float32)
        if isinstance(input_data, torch.Tensor):
            out = input_data.detach().clone()
        elif isinstance(input_data, np.ndarray):
            out = torch.from_numpy(np.ascontiguousarray(input_data).copy())
        else:
            out = torch.tensor(input_data)
            if dtype is None and out.is_floating_point():
                out = out.to(torch.float32)  # MindSpore infers float32 for Python floats
            elif dtype is None and out.dtype == torch.int64 and not isinstance(input_data, (list, tuple)):
                out = out.to(torch.int64)
        return out.to(dtype) if dtype is not None else out


class Parameter(torch.nn.Parameter):
    """``Parameter(default_input, name=None, requires_grad=True, layerwise_parallel=False, parallel_optimizer=True)``.

    ``default_input`` may be ``initializer(...)``'s tensor, a numpy array, a number or a list. Made inside
    ``nn.utils.no_init_parameters()`` it is an empty meta tensor whose initialisation is recorded until it is materialised.
    ``parallel_optimizer=False`` (keep this parameter out of optimizer sharding) is accepted and warned about: the
    optimizer sharding here shards every parameter of a module alike."""

    def __new__(cls, default_input: Any, name: str | None = None, requires_grad: bool = True,
                layerwise_parallel: bool = False, parallel_optimizer: bool = True, **kwargs: Any):
        from autopar.errors import warn_once

        if kwargs:
            warn_once("Parameter." + ",".join(sorted(kwargs)),
                      f"Parameter({', '.join(f'{k}=' for k in sorted(kwargs))}) is accepted and not applied")
        if not parallel_optimizer:
            warn_once("Parameter.parallel_optimizer", "Parameter(parallel_optimizer=False) is accepted and not "
                      "applied: optimizer sharding (enable_parallel_optimizer) shards every parameter")
        data = default_input if isinstance(default_input, torch.Tensor) else Tensor(default_input)
        # MindSpore flags an integer parameter (a counter, an overflow flag) trainable too; torch cannot
        requires_grad = requires_grad and (data.is_floating_point() or data.is_complex())
        param = super().__new__(cls, data.detach(), requires_grad)
        param._ms_name = name
        param.layerwise_parallel = bool(layerwise_parallel)
        return param

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # attributes are set in __new__
        pass

    # torch.Tensor has a read-only ``name``; MindSpore code reads and sets ``param.name``.
    @property
    def name(self) -> str | None:  # type: ignore[override]
        return self.__dict__.get("_ms_name")

    @name.setter
    def name(self, value: str | None) -> None:
        self.__dict__["_ms_name"] = value

    def value(self) -> torch.Tensor:
        """MindSpore's ``param.value()``: the parameter's tensor (its data, outside autograd)."""
        return self.detach()

    def set_data(self, data: Any, slice_shape: bool = False) -> "Parameter":
        """MindSpore's ``param.set_data(tensor)``: new values for this parameter (same object, so optimizers
        holding it keep it)."""
        data = data if isinstance(data, torch.Tensor) else Tensor(data)
        with torch.no_grad():
            if tuple(data.shape) == tuple(self.shape):
                self.copy_(data)
            else:
                self.data = data.to(self.dtype)
        return self

    def __deepcopy__(self, memo: dict) -> "Parameter":
        if id(self) in memo:
            return memo[id(self)]
        result = Parameter(self.data.clone(memory_format=torch.preserve_format), self.name, self.requires_grad,
                           self.layerwise_parallel)
        memo[id(self)] = result
        return result

    def __reduce_ex__(self, proto: int):
        return (_rebuild_parameter, (self.data, self.name, self.requires_grad, self.layerwise_parallel))

    def __repr__(self) -> str:
        return f"Parameter(name={self.name}, shape={tuple(self.shape)}, dtype={self.dtype}, " \
               f"requires_grad={self.requires_grad}, layerwise_parallel={self.layerwise_parallel})"


def _rebuild_parameter(data: torch.Tensor, name: str | None, requires_grad: bool, layerwise: bool) -> Parameter:
    return Parameter(data, name, requires_grad, layerwise)


def is_layerwise_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "layerwise_parallel", False))


class ParameterTuple(tuple):
    """MindSpore's ``ParameterTuple(net.trainable_params())``: a tuple of parameters (``clone`` copies them).

    Iterating or indexing yields each parameter as it trains now: one that a parallel mode replaced by its slice
    comes back as the replacement (:mod:`autopar.common.replaced`), an accumulation clone as one of its weight's
    layout (:mod:`autopar.common.accumulation`)."""

    def __iter__(self):
        from autopar.common.accumulation import follow

        return (follow(p) for p in tuple.__iter__(self))

    def __getitem__(self, index):
        from autopar.common.accumulation import follow

        item = tuple.__getitem__(self, index)
        return ParameterTuple(item) if isinstance(index, slice) else follow(item)

    def clone(self, prefix: str, init: str = "same") -> "ParameterTuple":
        """Copies named ``prefix.<name>`` (``init="zeros"``: zeros). ``prefix="accu_grads"`` makes MindSpore's
        gradient-accumulation buffers, which the gradient of an updating step adds in
        (:func:`autopar.common.accumulation.add_accumulated`)."""
        from autopar.common import accumulation

        if init not in ("same", "zeros"):
            from autopar.common.initializer import initializer

            fresh = [initializer(init, list(p.shape), p.dtype) for p in self]
        else:
            fresh = [p.detach().clone() if init == "same" else torch.zeros_like(p) for p in self]
        clones = ParameterTuple(Parameter(data, f"{prefix}.{getattr(p, 'name', None) or i}", p.requires_grad)
                                for i, (p, data) in enumerate(zip(tuple.__iter__(self), fresh)))
        if prefix == "accu_grads":
            for weight, clone in zip(tuple.__iter__(self), tuple.__iter__(clones)):
                accumulation.register(clone, weight)
        return clones
