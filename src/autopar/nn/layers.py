"""MindSpore's layers with MindSpore's arguments and defaults, each a subclass of the torch module it is.

``nn.Dense`` is a ``torch.nn.Linear`` (weight ``(out, in)``, as MindSpore's), ``nn.Conv2d`` a ``torch.nn.Conv2d``,
``nn.BatchNorm2d`` a ``torch.nn.BatchNorm2d`` ... so ``autopar.shard(dense, strategy)``, the AUTO planner and the
CPU convolution lowering treat them exactly as the torch modules, and state dicts keep torch's names. What differs
from torch is only what MindSpore defines differently:

* ``Conv2d``: ``pad_mode`` ``"same"`` (the default; output ``ceil(in / stride)``, the odd padding row/column at the
  bottom/right, for any stride -- torch's ``padding="same"`` allows stride 1 only), ``"valid"``, or ``"pad"`` with
  ``padding`` an int or ``(top, bottom, left, right)``; ``has_bias=False``; ``group``/``dilation``.
* ``BatchNorm``: ``momentum=0.9`` in MindSpore's convention (``moving = m * moving + (1 - m) * batch``), i.e.
  torch's ``1 - m``; ``gamma_init``/``beta_init``/``moving_mean_init``/``moving_var_init``; ``use_batch_statistics``.
* Initialisers: ``weight_init``/``bias_init`` take what ``common.initializer.initializer`` takes. ``None`` is
  MindSpore 2.x's default, HeUniform(sqrt(5)) and U(+-1/sqrt(fan_in)) -- the same distributions as torch's.
* Pooling: ``pad_mode`` ``"valid"`` (the default) or ``"same"``; ``LayerNorm``'s ``epsilon`` defaults to 1e-7.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from autopar.common.initializer import HeUniform, Uniform, initializer
from autopar.errors import ConfigError
from autopar.models.resnet import same_padding, torch_momentum
from autopar.nn.basic import activation_of
from autopar.nn.cell import Cell, torch_forward


def init_parameter(param: torch.Tensor, init: Any) -> None:
    """Fill ``param`` (a parameter or buffer) in place as ``initializer(init, its shape, its dtype)`` would (on the
    meta device, under ``no_init_parameters``, the fill is recorded)."""
    value = initializer(init, tuple(param.shape), param.dtype)
    with torch.no_grad():
        param.copy_(value)


def _fan_in_bound(weight_shape: tuple[int, ...]) -> float:
    fan_in = math.prod(weight_shape[1:])
    return 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0


def _apply_inits(layer) -> None:
    """Dense/Conv2d weights and bias from ``layer._inits`` (MindSpore 2.x defaults for None); nothing before the
    layer set them (torch's ``__init__`` calls ``reset_parameters`` first)."""
    inits = layer.__dict__.get("_inits")
    if inits is None:
        return
    weight_init, bias_init = inits
    init_parameter(layer.weight, HeUniform(math.sqrt(5)) if weight_init is None else weight_init)
    if layer.bias is not None:
        init_parameter(layer.bias, Uniform(_fan_in_bound(tuple(layer.weight.shape))) if bias_init is None
                       else bias_init)


def _check_format(name: str, data_format: str) -> None:
    if data_format != "NCHW":
        raise ConfigError(f"{name}: data_format={data_format!r} is not supported; autopar runs NCHW (torch's layout)")


class Dense(Cell, torch.nn.Linear):
    """``nn.Dense(in_channels, out_channels, weight_init=None, bias_init=None, has_bias=True, activation=None)``."""

    def __init__(self, in_channels: int, out_channels: int, weight_init: Any = None, bias_init: Any = None,
                 has_bias: bool = True, activation: Any = None, dtype: torch.dtype = torch.float32):
        torch.nn.Linear.__init__(self, in_channels, out_channels, bias=has_bias, dtype=dtype)
        self.in_channels, self.out_channels, self.has_bias = in_channels, out_channels, has_bias
        self._inits = (weight_init, bias_init)
        self.reset_parameters()
        self.activation = activation_of(activation)

    def reset_parameters(self) -> None:
        """MindSpore's initialisers (torch's own draws are skipped while torch's ``__init__`` runs: no wasted
        random numbers, so a network built eagerly and one built under ``no_init_parameters`` draw alike)."""
        _apply_inits(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.Linear.forward(self, x)
        return out if self.activation is None else self.activation(out)

    construct = forward


class Conv2d(Cell, torch.nn.Conv2d):
    """``nn.Conv2d(in_channels, out_channels, kernel_size, stride=1, pad_mode="same", padding=0, dilation=1,
    group=1, has_bias=False, weight_init=None, bias_init=None, data_format="NCHW")``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1,
                 pad_mode: str = "same", padding: Any = 0, dilation: Any = 1, group: int = 1, has_bias: bool = False,
                 weight_init: Any = None, bias_init: Any = None, data_format: str = "NCHW",
                 dtype: torch.dtype = torch.float32):
        _check_format("Conv2d", data_format)
        self.pad_mode = str(pad_mode).lower()
        if self.pad_mode not in ("same", "valid", "pad"):
            raise ConfigError(f"Conv2d: pad_mode must be 'same', 'valid' or 'pad', got {pad_mode!r}")
        pads = (padding,) * 4 if isinstance(padding, int) else tuple(padding)
        if len(pads) != 4 or any(not isinstance(p, int) or p < 0 for p in pads):
            raise ConfigError(f"Conv2d: padding must be a non-negative int or (top, bottom, left, right), got {padding!r}")
        if self.pad_mode != "pad" and any(pads):
            raise ConfigError(f"Conv2d: padding={padding!r} needs pad_mode='pad' (MindSpore allows padding only there)")
        torch.nn.Conv2d.__init__(self, in_channels, out_channels, kernel_size, stride=stride, padding=0,
                                 dilation=dilation, groups=group, bias=has_bias, dtype=dtype)
        self.in_channels, self.out_channels, self.has_bias, self.group = in_channels, out_channels, has_bias, group
        self.pads = pads
        self._inits = (weight_init, bias_init)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _apply_inits(self)

    def padding_for(self, x: torch.Tensor) -> tuple[int, int, int, int]:
        """(top, bottom, left, right) zero padding of input ``x`` (also read by the CPU small-map lowering)."""
        if self.pad_mode == "pad":
            return self.pads
        if self.pad_mode == "valid":
            return 0, 0, 0, 0
        kh, kw = ((k - 1) * d + 1 for k, d in zip(self.kernel_size, self.dilation))
        top, bottom = same_padding(x.shape[-2], kh, self.stride[0])
        left, right = same_padding(x.shape[-1], kw, self.stride[1])
        return top, bottom, left, right

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        top, bottom, left, right = self.padding_for(x)
        if top == bottom and left == right:
            return F.conv2d(x, weight, bias, self.stride, (top, left), self.dilation, self.groups)
        return F.conv2d(F.pad(x, (left, right, top, bottom)), weight, bias, self.stride, 0, self.dilation, self.groups)

    forward = construct = torch_forward(torch.nn.Conv2d)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", pad_mode={self.pad_mode}" + (f", pads={self.pads}" if any(self.pads) else "")


class _BatchNorm(Cell):
    """MindSpore's BatchNorm arguments on a torch BatchNorm (the subclasses pick which)."""

    _torch: type = torch.nn.BatchNorm2d

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.9, affine: bool = True,
                 gamma_init: Any = "ones", beta_init: Any = "zeros", moving_mean_init: Any = "zeros",
                 moving_var_init: Any = "ones", use_batch_statistics: bool | None = None, data_format: str = "NCHW",
                 dtype: torch.dtype = torch.float32):
        _check_format(type(self).__name__, data_format)
        if not 0.0 <= momentum <= 1.0:
            raise ConfigError(f"{type(self).__name__}: momentum must be in [0, 1], got {momentum}")
        self._torch.__init__(self, num_features, eps=eps, momentum=torch_momentum(momentum), affine=affine, dtype=dtype)
        self.num_features, self.use_batch_statistics = num_features, use_batch_statistics
        if affine:
            init_parameter(self.weight, gamma_init)
            init_parameter(self.bias, beta_init)
        init_parameter(self.running_mean, moving_mean_init)
        init_parameter(self.running_var, moving_var_init)

    @property
    def ms_momentum(self) -> float:
        """The momentum in MindSpore's convention (what was given)."""
        return 1.0 - self.momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_batch_statistics is None:
            return self._torch.forward(self, x)
        # True: always normalise with the batch's statistics (and update the moving ones); False: always with the
        # moving statistics, never updating them (MindSpore's use_batch_statistics)
        self._check_input_dim(x)
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                            bool(self.use_batch_statistics), self.momentum, self.eps)

    construct = forward


class BatchNorm2d(_BatchNorm, torch.nn.BatchNorm2d):
    """``nn.BatchNorm2d(num_features, eps=1e-5, momentum=0.9, affine=True, gamma_init='ones', beta_init='zeros',
    moving_mean_init='zeros', moving_var_init='ones', use_batch_statistics=None)``."""

    _torch = torch.nn.BatchNorm2d


class BatchNorm1d(_BatchNorm, torch.nn.BatchNorm1d):
    _torch = torch.nn.BatchNorm1d


class BatchNorm3d(_BatchNorm, torch.nn.BatchNorm3d):
    _torch = torch.nn.BatchNorm3d


class LayerNorm(Cell, torch.nn.LayerNorm):
    """``nn.LayerNorm(normalized_shape, begin_norm_axis=-1, begin_params_axis=-1, gamma_init='ones',
    beta_init='zeros', epsilon=1e-7)``: normalises the trailing ``len(normalized_shape)`` dimensions."""

    def __init__(self, normalized_shape: Any, begin_norm_axis: int = -1, begin_params_axis: int = -1,
                 gamma_init: Any = "ones", beta_init: Any = "zeros", epsilon: float = 1e-7,
                 dtype: torch.dtype = torch.float32):
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if begin_norm_axis not in (-len(shape),) and not (begin_norm_axis == -1 and len(shape) == 1):
            raise ConfigError(f"LayerNorm: begin_norm_axis={begin_norm_axis} must start the trailing {len(shape)} "
                              f"dimension(s) of normalized_shape {list(shape)} (give it as a negative axis)")
        torch.nn.LayerNorm.__init__(self, shape, eps=epsilon, dtype=dtype)
        init_parameter(self.weight, gamma_init)
        init_parameter(self.bias, beta_init)

    forward = construct = torch_forward(torch.nn.LayerNorm)


class Embedding(Cell, torch.nn.Embedding):
    """``nn.Embedding(vocab_size, embedding_size, use_one_hot=False, embedding_table='normal', dtype=int32,
    padding_idx=None)``: the table starts N(0, 0.01**2) (MindSpore), not N(0, 1) (torch)."""

    def __init__(self, vocab_size: int, embedding_size: int, use_one_hot: bool = False,
                 embedding_table: Any = "normal", dtype: Any = None, padding_idx: int | None = None):
        torch.nn.Embedding.__init__(self, vocab_size, embedding_size, padding_idx=padding_idx)
        self.vocab_size, self.embedding_size = vocab_size, embedding_size
        self._table = embedding_table
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if "_table" in self.__dict__:
            init_parameter(self.weight, self._table)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.Embedding.forward(self, ids.long())

    construct = forward


def _pool_pads(name: str, pad_mode: str, padding: Any) -> tuple[str, tuple[int, int, int, int]]:
    mode = str(pad_mode).lower()
    if mode not in ("same", "valid", "pad"):
        raise ConfigError(f"{name}: pad_mode must be 'same', 'valid' or 'pad', got {pad_mode!r}")
    pads = (padding,) * 4 if isinstance(padding, int) else tuple(padding)
    if len(pads) == 2:
        pads = (pads[0], pads[0], pads[1], pads[1])
    if mode != "pad" and any(pads):
        raise ConfigError(f"{name}: padding={padding!r} needs pad_mode='pad'")
    return mode, pads


def _pool_padding(module, x: torch.Tensor) -> tuple[int, int, int, int]:
    if module.pad_mode == "pad":
        return module.pads
    if module.pad_mode == "valid":
        return 0, 0, 0, 0
    kh, kw = module.kernel_size
    sh, sw = module.stride
    return same_padding(x.shape[-2], kh, sh) + same_padding(x.shape[-1], kw, sw)


def _pair(v: Any) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


class MaxPool2d(Cell, torch.nn.MaxPool2d):
    """``nn.MaxPool2d(kernel_size=1, stride=1, pad_mode="valid", padding=0)``; ``"same"`` pads with -inf (padding
    never wins the max), as MindSpore."""

    def __init__(self, kernel_size: Any = 1, stride: Any = 1, pad_mode: str = "valid", padding: Any = 0,
                 dilation: Any = 1, return_indices: bool = False, ceil_mode: bool = False, data_format: str = "NCHW"):
        _check_format("MaxPool2d", data_format)
        self.pad_mode, self.pads = _pool_pads("MaxPool2d", pad_mode, padding)
        torch.nn.MaxPool2d.__init__(self, _pair(kernel_size), _pair(stride), 0, dilation, return_indices, ceil_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, bottom, left, right = _pool_padding(self, x)
        if top or bottom or left or right:
            x = F.pad(x, (left, right, top, bottom), value=float("-inf"))
        return F.max_pool2d(x, self.kernel_size, self.stride, 0, self.dilation, self.ceil_mode, self.return_indices)

    construct = forward


class AvgPool2d(Cell, torch.nn.AvgPool2d):
    """``nn.AvgPool2d(kernel_size=1, stride=1, pad_mode="valid", padding=0)``; with ``"same"`` a window's mean is
    over its positions inside the input (padding is not counted)."""

    def __init__(self, kernel_size: Any = 1, stride: Any = 1, pad_mode: str = "valid", padding: Any = 0,
                 ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None,
                 data_format: str = "NCHW"):
        _check_format("AvgPool2d", data_format)
        self.pad_mode, self.pads = _pool_pads("AvgPool2d", pad_mode, padding)
        torch.nn.AvgPool2d.__init__(self, _pair(kernel_size), _pair(stride), 0, ceil_mode, count_include_pad,
                                    divisor_override)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, bottom, left, right = _pool_padding(self, x)
        if not (top or bottom or left or right):
            return F.avg_pool2d(x, self.kernel_size, self.stride, 0, self.ceil_mode, True, self.divisor_override)
        padded = F.pad(x, (left, right, top, bottom))
        total = F.avg_pool2d(padded, self.kernel_size, self.stride, 0, self.ceil_mode, True, self.divisor_override)
        if self.pad_mode == "pad" and self.count_include_pad:
            return total
        ones = F.pad(torch.ones_like(x[:1, :1]), (left, right, top, bottom))
        inside = F.avg_pool2d(ones, self.kernel_size, self.stride, 0, self.ceil_mode, True)
        return total / inside

    construct = forward


class AdaptiveAvgPool2d(Cell, torch.nn.AdaptiveAvgPool2d):
    def __init__(self, output_size: Any):
        torch.nn.AdaptiveAvgPool2d.__init__(self, output_size)

    forward = construct = torch_forward(torch.nn.AdaptiveAvgPool2d)
