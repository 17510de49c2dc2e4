"""Labels of any dtype meet a loss the way the loss wants them.

Pipelines yield class indices in many dtypes: uint8 or uint32 (MindSpore's ``Cifar10Dataset``), int32 (the tutorials'
``TypeCast``), float32/float16 (a ``TypeCast(mstype.float32)``) or bool (a binary label). torch's classification
losses take int64 indices only. So:

- integer labels always reach the loss as int64 (documented; an int64 index means the same class as any other
  integer dtype holding it);
- float and bool labels reach the loss as they are -- a regression loss wants them so, and a user's own cast wins --
  unless the loss refuses them for not being int64 *and* every value is a whole number: then they are passed as
  int64, and that loss keeps getting int64 from then on (one refusal per loss object, not one per step).

Below every layer: the loss callers in ``parallel``, ``nn`` and ``train`` all go through :func:`call_loss`.
"""
from __future__ import annotations

import re
import weakref
from typing import Any, Callable

import torch

# every integer dtype a pipeline yields but int64
NARROW_INTEGERS = (torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64)
# torch's words when a loss wants int64 class indices ("expected target dtype to be Long or Byte, but got Float";
# older releases: "expected scalar type Long but found Float")
_WANTS_INDICES = re.compile(r"expected (target dtype to be|scalar type) Long", re.IGNORECASE)
_takes_indices: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def class_indices(label: Any) -> Any:
    """Integer labels of any width as int64; everything else unchanged."""
    if isinstance(label, torch.Tensor) and label.dtype in NARROW_INTEGERS:
        return label.long()
    return label


def _whole_numbers(label: torch.Tensor) -> bool:
    if label.dtype == torch.bool:
        return True
    local = label.to_local() if hasattr(label, "to_local") else label
    return bool(torch.equal(local, local.round()))


def _remembered(loss_fn: Callable) -> bool:
    try:
        return _takes_indices.get(loss_fn, False)
    except TypeError:  # not weakly referenceable (a bound method's identity changes anyway)
        return False


def _remember(loss_fn: Callable) -> None:
    try:
        _takes_indices[loss_fn] = True
    except TypeError:
        pass


def call_loss(loss_fn: Callable, logits: Any, label: Any) -> Any:
    """``loss_fn(logits, label)`` with the label in the dtype the loss takes (see the module docstring)."""
    label = class_indices(label)
    if not isinstance(label, torch.Tensor) or not (label.is_floating_point() or label.dtype == torch.bool):
        return loss_fn(logits, label)
    if _remembered(loss_fn):
        return loss_fn(logits, label.long())
    try:
        return loss_fn(logits, label)
    except RuntimeError as exc:
        if not _WANTS_INDICES.search(str(exc)) or not _whole_numbers(label):
            raise
    _remember(loss_fn)
    return loss_fn(logits, label.long())
