"""Convolutions with at most four output positions, lowered to one matrix multiply (a CPU speed default).

Why: oneDNN, torch's CPU convolution engine, is slow on tiny feature maps, above all in the backward pass. The
tutorial's ResNet-50 on 32x32 CIFAR images ends at 2x2 and 1x1 maps, and there (measured on this 2-core CPU,
batch 32, forward + backward) a 3x3 convolution over a 1x1 map takes 54 ms in oneDNN and 4.4 ms as the matrix
multiply it really is; layer3/layer4 took about 40 % of a training step. The same results come from:

- one output position (1x1): the kernel taps that see padding only multiply zeros, so the convolution is a
  ``linear`` of the input window with the taps that land inside it -- the other taps' gradient is exactly zero,
  as in the convolution;
- two to four output positions: ``unfold`` (im2col) and one GEMM, whose backward is a GEMM and a ``fold``; a
  1x1 convolution there is one ``linear`` over the channels of every position.

Only the summation order differs (float tolerance). Larger maps, grouped or dilated convolutions and non-zero
padding modes keep torch's kernel, and so does any device other than the CPU (not measured there).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_POSITIONS = 4  # output positions up to which the GEMM form won (2x2: 9.8 -> 7.3 ms; 4x4 lost: 6.3 -> 8.4 ms)


def _pads(conv: torch.nn.Conv2d, x: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(top, bottom, left, right) padding the convolution applies to ``x``."""
    padding_for = getattr(conv, "padding_for", None)
    if padding_for is not None:  # autopar's SameConv2d: MindSpore's pad_mode="same", computed per input
        return tuple(padding_for(x))
    if conv.padding == "valid":
        return 0, 0, 0, 0
    if conv.padding == "same":
        (kh, kw) = conv.kernel_size
        return (kh - 1) // 2, kh - 1 - (kh - 1) // 2, (kw - 1) // 2, kw - 1 - (kw - 1) // 2
    ph, pw = conv.padding
    return ph, ph, pw, pw


def lowered_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, int],
                   pads: tuple[int, int, int, int]) -> torch.Tensor | None:
    """``conv2d`` (groups 1, dilation 1, zero padding) as a matrix multiply, or None when it would not gain."""
    n, _, h, w = x.shape
    out_ch, _, kh, kw = weight.shape
    top, bottom, left, right = pads
    ho = (h + top + bottom - kh) // stride[0] + 1
    wo = (w + left + right - kw) // stride[1] + 1
    if ho < 1 or wo < 1 or ho * wo > MAX_POSITIONS:
        return None
    if ho == 1 and wo == 1:
        # the only window covers input rows -top .. kh-1-top: keep the kernel rows (and columns) inside the input
        rows, cols = min(kh, top + h) - top, min(kw, left + w) - left
        if rows < 1 or cols < 1:
            return None
        window = x[:, :, :rows, :cols].reshape(n, -1)
        taps = weight[:, :, top:top + rows, left:left + cols].reshape(out_ch, -1)
        return F.linear(window, taps, bias).view(n, out_ch, 1, 1)
    if kh == kw == 1 and stride == (1, 1) and pads == (0, 0, 0, 0):
        # every position is a sample of one linear map over the channels (2x2, 256 -> 1024: 5.1 -> 2.8 ms)
        y = F.linear(x.permute(0, 2, 3, 1).reshape(-1, x.shape[1]), weight.view(out_ch, -1), bias)
        return y.view(n, ho, wo, out_ch).permute(0, 3, 1, 2)
    if top == bottom and left == right:
        columns = F.unfold(x, (kh, kw), padding=(top, left), stride=stride)
    else:
        columns = F.unfold(F.pad(x, (left, right, top, bottom)), (kh, kw), stride=stride)
    y = weight.reshape(out_ch, -1) @ columns  # (n, out, positions)
    if bias is not None:
        y = y + bias.view(1, -1, 1)
    return y.view(n, out_ch, ho, wo)


class SmallOutputConv:
    """Stands in for one convolution module's ``_conv_forward``: the GEMM form where it gains, torch's otherwise.

    An instance attribute (not a subclass swap) so the module keeps its class, parameters and state dict."""

    def __init__(self, conv: torch.nn.Conv2d):
        self.conv = conv

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        conv = self.conv
        if x.dim() == 4 and x.device.type == "cpu" and type(weight) in (torch.Tensor, torch.nn.Parameter):
            y = lowered_conv2d(x, weight, bias, conv.stride, _pads(conv, x))
            if y is not None:
                return y
        return type(conv)._conv_forward(conv, x, weight, bias)


def eligible(module: torch.nn.Module) -> bool:
    return (isinstance(module, torch.nn.Conv2d) and module.groups == 1 and tuple(module.dilation) == (1, 1)
            and module.padding_mode == "zeros")


def install(network: torch.nn.Module) -> int:
    """Route every eligible convolution of ``network`` through :class:`SmallOutputConv`; returns how many."""
    count = 0
    for module in network.modules():
        if eligible(module) and not isinstance(module.__dict__.get("_conv_forward"), SmallOutputConv):
            module._conv_forward = SmallOutputConv(module)
            count += 1
    return count
