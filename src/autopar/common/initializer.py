"""``mindspore.common.initializer``: ``initializer(init, shape, dtype)`` and the ``Initializer`` classes, on
``torch.nn.init``.

``Parameter(initializer("normal", [784, 512], ms.float32))`` gives a tensor drawn from torch's global generator (so
``autopar.set_seed`` makes it reproducible). Every class keeps MindSpore's defaults, which are not torch's:
``Normal`` is N(0, 0.01**2), ``Uniform`` U(-0.07, 0.07), ``TruncatedNormal`` N(0, 0.01**2) cut at [-2, 2] (absolute
bounds, as torch's ``trunc_normal_``); ``XavierUniform``/``HeUniform``/``HeNormal`` use MindSpore's fans, which for a
2-D shape ``(a, b)`` are fan_in = b, fan_out = a -- torch's convention for a ``(out, in)`` weight. A string names
the class (``"normal"``, ``"zeros"``, ``"ones"``, ``"uniform"``, ``"xavier_uniform"``, ``"he_uniform"``,
``"he_normal"``, ``"truncatedNormal"``, ... case and underscores ignored, as MindSpore); a number is ``Constant``.

Inside ``autopar.nn.utils.no_init_parameters()`` (torch's meta device) the tensor is an empty meta tensor; how it
was filled is recorded (:mod:`autopar.common.deferred`) and replayed when it is materialised.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from autopar.errors import ConfigError


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) < 2:
        raise ConfigError(f"initializer: fan in/out need a shape of at least 2 dimensions, got {list(shape)}")
    receptive = math.prod(shape[2:]) if len(shape) > 2 else 1
    return shape[1] * receptive, shape[0] * receptive


class Initializer:
    """Base class: ``init(tensor)`` fills ``tensor`` in place (``__call__`` on a numpy array, as MindSpore)."""

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs

    def fill(self, tensor: torch.Tensor) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, arr: Any) -> Any:
        if isinstance(arr, np.ndarray):
            t = torch.from_numpy(arr)
            with torch.no_grad():
                self.fill(t)
            return arr
        with torch.no_grad():
            self.fill(arr)
        return arr

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self._kwargs.items())
        return f"{type(self).__name__}({args})"


class Zero(Initializer):
    def fill(self, tensor):
        tensor.zero_()


class One(Initializer):
    def fill(self, tensor):
        tensor.fill_(1)


class Constant(Initializer):
    def __init__(self, value: float):
        super().__init__(value=value)
        self.value = value

    def fill(self, tensor):
        tensor.fill_(self.value)


class Normal(Initializer):
    """N(mean, sigma**2); MindSpore's default sigma is 0.01."""

    def __init__(self, sigma: float = 0.01, mean: float = 0.0):
        super().__init__(sigma=sigma, mean=mean)
        self.sigma, self.mean = sigma, mean

    def fill(self, tensor):
        torch.nn.init.normal_(tensor, self.mean, self.sigma)


class Uniform(Initializer):
    """U(-scale, scale); MindSpore's default scale is 0.07."""

    def __init__(self, scale: float = 0.07):
        super().__init__(scale=scale)
        self.scale = scale

    def fill(self, tensor):
        torch.nn.init.uniform_(tensor, -self.scale, self.scale)


class TruncatedNormal(Initializer):
    """N(mean, sigma**2) redrawn outside [a, b] (absolute bounds); MindSpore's defaults 0.01, 0, -2, 2."""

    def __init__(self, sigma: float = 0.01, mean: float = 0.0, a: float = -2.0, b: float = 2.0):
        super().__init__(sigma=sigma, mean=mean, a=a, b=b)
        self.sigma, self.mean, self.a, self.b = sigma, mean, a, b

    def fill(self, tensor):
        torch.nn.init.trunc_normal_(tensor, self.mean, self.sigma, self.a, self.b)


class XavierUniform(Initializer):
    """U(-b, b), b = gain * sqrt(6 / (fan_in + fan_out))."""

    def __init__(self, gain: float = 1.0):
        super().__init__(gain=gain)
        self.gain = gain

    def fill(self, tensor):
        fan_in, fan_out = _fans(tuple(tensor.shape))
        bound = self.gain * math.sqrt(6.0 / (fan_in + fan_out))
        torch.nn.init.uniform_(tensor, -bound, bound)


class XavierNormal(XavierUniform):
    """N(0, std**2), std = gain * sqrt(2 / (fan_in + fan_out))."""

    def fill(self, tensor):
        fan_in, fan_out = _fans(tuple(tensor.shape))
        torch.nn.init.normal_(tensor, 0.0, self.gain * math.sqrt(2.0 / (fan_in + fan_out)))


class HeUniform(Initializer):
    """Kaiming uniform: U(-b, b), b = gain * sqrt(3 / fan), gain = sqrt(2 / (1 + negative_slope**2)) for
    leaky_relu (torch's ``calculate_gain``). ``HeUniform(math.sqrt(5))`` is torch's default for Linear/Conv."""

    def __init__(self, negative_slope: float = 0, mode: str = "fan_in", nonlinearity: str = "leaky_relu"):
        super().__init__(negative_slope=negative_slope, mode=mode, nonlinearity=nonlinearity)
        if mode not in ("fan_in", "fan_out"):
            raise ConfigError(f"{type(self).__name__}: mode must be 'fan_in' or 'fan_out', got {mode!r}")
        self.negative_slope, self.mode, self.nonlinearity = negative_slope, mode, nonlinearity

    def _std(self, tensor) -> float:
        fan_in, fan_out = _fans(tuple(tensor.shape))
        gain = torch.nn.init.calculate_gain(self.nonlinearity, self.negative_slope)
        return gain / math.sqrt(fan_in if self.mode == "fan_in" else fan_out)

    def fill(self, tensor):
        bound = math.sqrt(3.0) * self._std(tensor)
        torch.nn.init.uniform_(tensor, -bound, bound)


class HeNormal(HeUniform):
    def fill(self, tensor):
        torch.nn.init.normal_(tensor, 0.0, self._std(tensor))


class Orthogonal(Initializer):
    def __init__(self, gain: float = 1.0):
        super().__init__(gain=gain)
        self.gain = gain

    def fill(self, tensor):
        torch.nn.init.orthogonal_(tensor, self.gain)


class Identity(Initializer):
    def fill(self, tensor):
        if tensor.dim() != 2:
            raise ConfigError(f"Identity initializer needs a 2-D shape, got {list(tensor.shape)}")
        torch.nn.init.eye_(tensor)


_BY_NAME = {"zeros": Zero, "zero": Zero, "ones": One, "one": One, "normal": Normal, "uniform": Uniform,
            "truncatednormal": TruncatedNormal, "xavieruniform": XavierUniform, "xaviernormal": XavierNormal,
            "heuniform": HeUniform, "henormal": HeNormal, "orthogonal": Orthogonal, "identity": Identity}


def _as_initializer(init: Any) -> Initializer | torch.Tensor:
    if isinstance(init, Initializer):
        return init
    if isinstance(init, type) and issubclass(init, Initializer):
        return init()
    if isinstance(init, str):
        cls = _BY_NAME.get(init.replace("_", "").lower())
        if cls is None:
            raise ConfigError(f"initializer: unknown initializer {init!r}; known: {', '.join(sorted(_BY_NAME))}")
        return cls()
    if isinstance(init, bool) or not isinstance(init, (int, float, np.ndarray, torch.Tensor)):
        raise ConfigError(f"initializer: init must be a string, an Initializer, a number or a tensor, got {init!r}")
    if isinstance(init, (int, float)):
        return Constant(init)
    return torch.as_tensor(init)


def initializer(init: Any, shape: Any = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` filled by ``init`` (see the module docstring). A tensor ``init`` is copied
    (its shape must match ``shape`` when one is given)."""
    how = _as_initializer(init)
    if isinstance(how, torch.Tensor):
        if shape is not None and tuple(how.shape) != tuple(_shape(shape)):
            raise ConfigError(f"initializer: the tensor's shape {list(how.shape)} is not {list(_shape(shape))}")
        return how.detach().clone().to(dtype if dtype is not None else how.dtype)
    if shape is None:
        raise ConfigError(f"initializer: {how!r} needs a shape")
    dims = _shape(shape)
    dtype = dtype if dtype is not None else torch.float32
    out = torch.empty(dims, dtype=dtype)
    how(out)
    return out


def _shape(shape: Any) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ConfigError(f"initializer: negative dimension in shape {list(dims)}")
    return dims


__all__ = ["Constant", "HeNormal", "HeUniform", "Identity", "Initializer", "Normal", "One", "Orthogonal",
           "TruncatedNormal", "Uniform", "XavierNormal", "XavierUniform", "Zero", "initializer"]
