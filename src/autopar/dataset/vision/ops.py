"""Vision transforms, vectorised over a whole batch (``autopar.dataset.vision``).

Why batch-first: CIFAR-sized images are tiny, so per-image Python calls would dominate the cost of the input
pipeline. Every transform here works on ``(N, H, W[, C])`` in a constant number of numpy/torch calls: a random
crop is one pad plus one advanced-indexing gather with per-image offsets, a flip is a boolean mask, a resize is
one ``torch.nn.functional.interpolate``. Calling a transform on one ``(H, W[, C])`` image goes through the same
code with N = 1.

Random draws (contract relied on by the tests and by exact resume): for a batch of N images
``RandomCrop`` draws ``rng.integers(0, H_pad - h + 1, N)`` (tops) then ``rng.integers(0, W_pad - w + 1, N)``
(lefts); the flips draw ``rng.random(N) < prob``.
"""
from __future__ import annotations

import enum
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from autopar.dataset.transforms.ops import Transform
from autopar.errors import DatasetError


class Inter(enum.Enum):
    """Interpolation modes of :class:`Resize` (MindSpore names; LINEAR is an alias of BILINEAR)."""

    NEAREST = "nearest"
    BILINEAR = "bilinear"
    LINEAR = "bilinear"
    BICUBIC = "bicubic"
    CUBIC = "bicubic"
    AREA = "area"


class Border(enum.Enum):
    """Padding modes of :class:`RandomCrop` (values are the ``numpy.pad`` modes)."""

    CONSTANT = "constant"
    EDGE = "edge"
    REFLECT = "reflect"
    SYMMETRIC = "symmetric"


def _size2(size: Any, name: str) -> tuple[int, int]:
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        size = (int(size), int(size))
    try:
        h, w = (int(v) for v in size)
    except (TypeError, ValueError):
        raise DatasetError(f"{name}: size must be an int or a (height, width) pair, got {size!r}") from None
    if h <= 0 or w <= 0:
        raise DatasetError(f"{name}: size must be positive, got {size!r}")
    return h, w


def _nhwc(batch: np.ndarray, name: str) -> tuple[np.ndarray, bool]:
    """View a batch as (N, H, W, C); the flag says a channel axis was added (grayscale input)."""
    batch = np.asarray(batch)
    if batch.ndim == 3:
        return batch[..., None], True
    if batch.ndim == 4:
        return batch, False
    raise DatasetError(f"{name}: expected images (H, W[, C]) or a batch (N, H, W[, C]), got shape {batch.shape}")


def _fill_array(fill: Any, channels: int, dtype: np.dtype, name: str) -> np.ndarray:
    fill = np.asarray(fill, dtype=np.float64).reshape(-1)
    if fill.size not in (1, channels):
        raise DatasetError(f"{name}: fill_value has {fill.size} values for {channels} channels")
    return fill.astype(dtype)


def _pad(x: np.ndarray, top: int, bottom: int, left: int, right: int, mode: Border, fill: Any, name: str):
    """Pad an (N, H, W, C) batch on H and W."""
    if not (top or bottom or left or right):
        return x
    n, h, w, c = x.shape
    if mode is Border.CONSTANT:
        out = np.empty((n, h + top + bottom, w + left + right, c), dtype=x.dtype)
        out[...] = _fill_array(fill, c, x.dtype, name)
        out[:, top:top + h, left:left + w] = x
        return out
    if mode is Border.REFLECT and (max(top, bottom) >= h or max(left, right) >= w):
        raise DatasetError(f"{name}: REFLECT padding ({left}, {top}, {right}, {bottom}) needs an image larger "
                           f"than the padding, got {h}x{w}")
    return np.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)), mode=mode.value)


def _border(mode: Any, name: str) -> Border:
    if isinstance(mode, Border):
        return mode
    try:
        return Border(str(mode).lower().rsplit(".", 1)[-1])
    except ValueError:
        raise DatasetError(f"{name}: unknown padding_mode {mode!r} (use Border.CONSTANT/EDGE/REFLECT/SYMMETRIC)") \
            from None


class RandomCrop(Transform):
    """Crop a random ``size`` window after optional padding (MindSpore ``RandomCrop``).

    ``padding``: int (all sides), 2-tuple (left/right, top/bottom) or 4-tuple (left, top, right, bottom).
    ``pad_if_needed``: pad on both sides of an axis by the missing amount when the (padded) image is smaller
    than ``size``. ``fill_value``: int or per-channel tuple for ``Border.CONSTANT``.
    """

    image_op = True
    random = True

    def __init__(self, size, padding=None, pad_if_needed=False, fill_value=0, padding_mode=Border.CONSTANT):
        self.size = _size2(size, "RandomCrop")
        if padding is None:
            pad = (0, 0, 0, 0)
        elif isinstance(padding, (int, np.integer)):
            pad = (int(padding),) * 4
        else:
            padding = tuple(int(p) for p in padding)
            if len(padding) == 2:
                pad = (padding[0], padding[1], padding[0], padding[1])
            elif len(padding) == 4:
                pad = padding
            else:
                raise DatasetError(f"RandomCrop: padding must be an int, a 2-tuple or a 4-tuple, got {padding!r}")
        if min(pad) < 0:
            raise DatasetError(f"RandomCrop: padding must be non-negative, got {padding!r}")
        self.padding = pad  # (left, top, right, bottom)
        self.pad_if_needed = bool(pad_if_needed)
        self.fill_value = fill_value
        self.padding_mode = _border(padding_mode, "RandomCrop")

    def apply_batch(self, batch, rng):
        x, gray = _nhwc(batch, "RandomCrop")
        h, w = self.size
        left, top, right, bottom = self.padding
        x = _pad(x, top, bottom, left, right, self.padding_mode, self.fill_value, "RandomCrop")
        if self.pad_if_needed and (x.shape[1] < h or x.shape[2] < w):
            dh, dw = max(h - x.shape[1], 0), max(w - x.shape[2], 0)
            x = _pad(x, dh, dh, dw, dw, self.padding_mode, self.fill_value, "RandomCrop")
        n, hp, wp, _ = x.shape
        if hp < h or wp < w:
            raise DatasetError(f"RandomCrop: crop size {h}x{w} is larger than the padded image {hp}x{wp} "
                               "(set pad_if_needed=True or a smaller size)")
        if (hp, wp) == (h, w):
            out = x if x is not batch else x.copy()
        else:
            tops = rng.integers(0, hp - h + 1, size=n)
            lefts = rng.integers(0, wp - w + 1, size=n)
            rows = (tops[:, None] + np.arange(h))[:, :, None]
            cols = (lefts[:, None] + np.arange(w))[:, None, :]
            out = x[np.arange(n)[:, None, None], rows, cols]
        return out[..., 0] if gray else out


class _RandomFlip(Transform):
    image_op = True
    random = True
    _axis = 2

    def __init__(self, prob: float = 0.5):
        prob = float(prob)
        if not 0.0 <= prob <= 1.0:
            raise DatasetError(f"{type(self).__name__}: prob must be in [0, 1], got {prob}")
        self.prob = prob

    def apply_batch(self, batch, rng):
        batch = np.asarray(batch)
        if batch.ndim not in (3, 4):
            raise DatasetError(f"{type(self).__name__}: expected images (H, W[, C]), got batch shape {batch.shape}")
        mask = rng.random(batch.shape[0]) < self.prob
        out = batch.copy()
        if mask.any():
            flipped = batch[mask]
            out[mask] = flipped[:, ::-1] if self._axis == 1 else flipped[:, :, ::-1]
        return out


class RandomHorizontalFlip(_RandomFlip):
    """Mirror left-right with probability ``prob``."""

    _axis = 2


class RandomVerticalFlip(_RandomFlip):
    """Mirror top-bottom with probability ``prob``."""

    _axis = 1


class Resize(Transform):
    """Resize to ``size``: an int resizes the shorter side keeping the aspect ratio, a pair is (height, width).

    Bilinear is ``torch.nn.functional.interpolate(mode="bilinear", align_corners=False, antialias=False)`` on
    float32; uint8 input gives uint8 output (rounded, clipped), float input keeps its dtype.
    """

    image_op = True

    def __init__(self, size, interpolation=Inter.LINEAR):
        if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
            if size <= 0:
                raise DatasetError(f"Resize: size must be positive, got {size}")
            self.size: int | tuple[int, int] = int(size)
        else:
            self.size = _size2(size, "Resize")
        if not isinstance(interpolation, Inter):
            try:
                interpolation = Inter[str(interpolation).upper().rsplit(".", 1)[-1]]
            except KeyError:
                raise DatasetError(f"Resize: unknown interpolation {interpolation!r}") from None
        self.interpolation = interpolation

    def output_size(self, h: int, w: int) -> tuple[int, int]:
        if isinstance(self.size, tuple):
            return self.size
        s = self.size
        return (s, int(s * w / h)) if h <= w else (int(s * h / w), s)

    def apply_batch(self, batch, rng=None):
        x, gray = _nhwc(batch, "Resize")
        n, h, w, c = x.shape
        oh, ow = self.output_size(h, w)
        if (oh, ow) == (h, w):
            return np.asarray(batch)
        mode = self.interpolation.value
        t = torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2).to(torch.float32)
        kwargs = {"align_corners": False, "antialias": False} if mode in ("bilinear", "bicubic") else {}
        y = F.interpolate(t, size=(oh, ow), mode=mode, **kwargs)
        # Back to NHWC: a free view when torch kept the channels-last layout of the input. Rounding in numpy
        # is several times faster than torch element-wise ops on a channels-last tensor.
        arr = y.permute(0, 2, 3, 1).numpy()
        if x.dtype.kind in "iub":
            lo, hi = (0, 1) if x.dtype.kind == "b" else (np.iinfo(x.dtype).min, np.iinfo(x.dtype).max)
            arr = np.rint(arr)
            np.clip(arr, lo, hi, out=arr)
        out = np.ascontiguousarray(arr.astype(x.dtype, copy=False))
        return out[..., 0] if gray else out


class CenterCrop(Transform):
    """Crop the central ``size`` window (top/left offsets ``(H - h) // 2``); smaller images are zero-padded."""

    image_op = True

    def __init__(self, size):
        self.size = _size2(size, "CenterCrop")

    def apply_batch(self, batch, rng=None):
        x, gray = _nhwc(batch, "CenterCrop")
        h, w = self.size
        dh, dw = max(h - x.shape[1], 0), max(w - x.shape[2], 0)
        if dh or dw:
            x = _pad(x, dh // 2, dh - dh // 2, dw // 2, dw - dw // 2, Border.CONSTANT, 0, "CenterCrop")
        top, left = (x.shape[1] - h) // 2, (x.shape[2] - w) // 2
        out = np.ascontiguousarray(x[:, top:top + h, left:left + w])
        return out[..., 0] if gray else out


class Rescale(Transform):
    """``x * rescale + shift`` as float32."""

    def __init__(self, rescale: float, shift: float):
        self.rescale = float(rescale)
        self.shift = float(shift)

    def apply_batch(self, batch, rng=None):
        out = np.multiply(batch, np.float32(self.rescale), dtype=np.float32)
        if self.shift:
            out += np.float32(self.shift)
        return out


class Normalize(Transform):
    """``(x - mean) / std`` per channel (last axis of HWC images) as float32."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean = tuple(float(m) for m in np.asarray(mean, dtype=np.float64).reshape(-1))
        self.std = tuple(float(s) for s in np.asarray(std, dtype=np.float64).reshape(-1))
        if len(self.mean) != len(self.std) or not self.mean:
            raise DatasetError(f"Normalize: mean and std must have the same non-zero length, got "
                               f"{len(self.mean)} and {len(self.std)}")
        if min(self.std) <= 0:
            raise DatasetError(f"Normalize: std values must be positive, got {list(self.std)}")
        self._mean = np.asarray(self.mean, dtype=np.float32)
        self._std = np.asarray(self.std, dtype=np.float32)

    def apply_batch(self, batch, rng=None):
        batch = np.asarray(batch)
        c = self._mean.size
        if c > 1 and (batch.ndim < 1 or batch.shape[-1] != c):
            raise DatasetError(f"Normalize: {c} mean/std values but images of shape {batch.shape[1:]} "
                               "(expects channels last, before HWC2CHW)")
        mean, std = self._mean, self._std
        if c > 1 and batch.ndim >= 2 and batch.flags.c_contiguous:
            # Broadcasting over a length-3 last axis runs numpy's inner loop 3 elements at a time; viewing rows
            # as (.., W*C) with the per-channel constants tiled W times gives the same numbers ~5x faster.
            w = batch.shape[-2]
            out = np.subtract(batch.reshape(-1, w * c), np.tile(mean, w), dtype=np.float32)
            out /= np.tile(std, w)
            return out.reshape(batch.shape)
        out = np.subtract(batch, mean, dtype=np.float32)
        out /= std
        return out


class HWC2CHW(Transform):
    """Move channels first: (H, W, C) -> (C, H, W); a 2-D image gets a channel axis of 1."""

    image_op = True

    def apply_batch(self, batch, rng=None):
        batch = np.asarray(batch)
        if batch.ndim == 3:
            return np.ascontiguousarray(batch[:, None])
        if batch.ndim != 4:
            raise DatasetError(f"HWC2CHW: expected images (H, W, C), got batch shape {batch.shape}")
        return np.ascontiguousarray(batch.transpose(0, 3, 1, 2))


__all__ = [
    "Border", "CenterCrop", "HWC2CHW", "Inter", "Normalize", "RandomCrop", "RandomHorizontalFlip",
    "RandomVerticalFlip", "Rescale", "Resize",
]
