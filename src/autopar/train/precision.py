"""Mixed precision for ``Model(amp_level=...)``: MindSpore's levels mapped onto torch autocast.

MindSpore's levels and what they become here:

- ``"O0"``: float32 throughout (the default, as in MindSpore).
- ``"O1"``: autocast -- matmuls and convolutions run in the low-precision dtype, everything torch's autocast
  keeps in float32 (softmax, norms, losses) stays there. Parameters and optimizer state stay float32.
- ``"O2"``: O1 plus dynamic loss scaling when the dtype is float16 (MindSpore's O2 default, ``GradScaler``);
  bfloat16 has float32's exponent range and needs no scaling.
- ``"O3"``: the whole network in the low-precision dtype (parameters included), as MindSpore's O3; inputs are
  cast on the way in. No float32 master weights: use it for inference-like experiments, not long training.

The low-precision dtype is bfloat16 on the CPU, and on a GPU bfloat16 where the device supports it, float16
otherwise (``AUTOPAR_AMP_DTYPE=float16|bfloat16`` overrides). On a CPU without native bf16 arithmetic
(no AVX512-BF16/AMX) autocast is much slower than float32 (ResNet-50 on this 2-core AVX2 EPYC: 26 s vs
0.6 s per step), so O0 stays the default.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch

from autopar.errors import ConfigError

LEVELS = ("O0", "O1", "O2", "O3")


@dataclass
class Precision:
    level: str
    device_type: str
    dtype: torch.dtype | None  # None at O0
    scaler: Any = None  # torch.amp.GradScaler at O2 with float16

    def autocast(self):
        """Context for forward + loss (a no-op at O0 and O3, whose casts are done once up front)."""
        if self.level in ("O1", "O2"):
            return torch.autocast(self.device_type, dtype=self.dtype)
        return contextlib.nullcontext()

    def cast_inputs(self, items: list) -> list:
        if self.level != "O3":
            return items
        return [t.to(self.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in items]

    def backward(self, loss: torch.Tensor) -> None:
        """A loss of several elements (MindSpore's per-sample losses) is back-propagated with a sensitivity of ones,
        as MindSpore's training cells do."""
        loss = self.scaler.scale(loss) if self.scaler is not None else loss
        loss.backward(torch.ones_like(loss) if loss.numel() != 1 else None)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)  # skips the step when a gradient overflowed, as MindSpore's loss scale
            self.scaler.update()
        else:
            optimizer.step()


def low_precision_dtype(device: torch.device) -> torch.dtype:
    forced = os.environ.get("AUTOPAR_AMP_DTYPE")
    if forced:
        if forced not in ("float16", "bfloat16"):
            raise ConfigError(f"AUTOPAR_AMP_DTYPE must be float16 or bfloat16, got {forced!r}")
        return getattr(torch, forced)
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def make_precision(level: str, device: torch.device, network: torch.nn.Module | None = None) -> Precision:
    """Validate ``level`` and set it up on ``device`` (O3 casts ``network`` in place)."""
    level = str(level).upper()
    if level not in LEVELS:
        raise ConfigError(f"amp_level must be one of {', '.join(LEVELS)}, got {level!r}")
    if level == "O0":
        return Precision(level, device.type, None)
    dtype = low_precision_dtype(device)
    scaler = None
    if level == "O2" and dtype == torch.float16:
        scaler = torch.amp.GradScaler(device.type)
    if level == "O3" and network is not None:
        network.to(dtype)
    return Precision(level, device.type, dtype, scaler)
