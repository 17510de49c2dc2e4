"""MindSpore parameter names onto torch's and back, for the tensors of a ``.ckpt`` file (read by
:mod:`autopar.checkpoint.mindspore_ckpt`): norm layers' ``gamma``/``beta``/``moving_*`` leaves, ``nn.Momentum``'s
``moments.`` slots as SGD momentum buffers, the rest by identical names."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from autopar.errors import CheckpointError

__all__ = ["mindspore_named_tensors", "mindspore_to_torch_state", "torch_to_mindspore_names"]

# MindSpore parameter leaf -> torch state_dict leaf (BatchNorm; LayerNorm/GroupNorm use gamma/beta too).
_MS_TO_TORCH_LEAF = {"gamma": "weight", "beta": "bias", "moving_mean": "running_mean",
                     "moving_variance": "running_var"}
_TORCH_TO_MS_LEAF = {v: k for k, v in _MS_TO_TORCH_LEAF.items()}
_MOMENTS = "moments."  # nn.Momentum: ``self.moments = self.params.clone(prefix="moments", init='zeros')``



def _ms_to_torch_name(name: str) -> str:
    prefix, dot, leaf = name.rpartition(".")
    return prefix + dot + _MS_TO_TORCH_LEAF.get(leaf, leaf)


def torch_to_mindspore_names(module: nn.Module) -> dict[str, str]:
    """``{torch state_dict name: MindSpore parameter name}`` for every tensor MindSpore would save.

    Norm layers (BatchNorm/InstanceNorm, LayerNorm, GroupNorm) get ``gamma``/``beta`` (and BatchNorm
    ``moving_mean``/``moving_variance``); every other name is kept. ``num_batches_tracked`` has no MindSpore
    counterpart and is left out. This is the inverse of the renaming in :func:`mindspore_to_torch_state`.
    """
    norm_types = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
    norms = {name for name, sub in module.named_modules() if isinstance(sub, norm_types)}
    names: dict[str, str] = {}
    for key in module.state_dict():
        prefix, dot, leaf = key.rpartition(".")
        if prefix in norms or (not dot and "" in norms):
            if leaf == "num_batches_tracked":
                continue
            leaf = _TORCH_TO_MS_LEAF.get(leaf, leaf)
        names[key] = prefix + dot + leaf
    return names


def mindspore_to_torch_state(ms_tensors: Mapping[str, Any], module: nn.Module, *, strict: bool = True,
                             rename: Mapping[str, str] | None = None,
                             ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[str]]:
    """Map MindSpore checkpoint tensors onto ``module``'s state_dict names.

    Returns ``(model_state, momentum_state, unmapped_names)``:

    * ``model_state`` -- for ``module.load_state_dict``: renamed by ``.gamma -> .weight``, ``.beta -> .bias``,
      ``.moving_mean -> .running_mean``, ``.moving_variance -> .running_var``, identical names otherwise;
      ``num_batches_tracked`` buffers (absent from MindSpore) are filled from the module so a strict
      ``load_state_dict`` works.
    * ``momentum_state`` -- ``moments.<param>`` of MindSpore's ``nn.Momentum`` keyed by the torch parameter
      name. Momentum's ``v = m * v + g; p -= lr * v`` is ``torch.optim.SGD(momentum=m, dampening=0,
      nesterov=False)``, so each tensor is that parameter's ``momentum_buffer``.
    * ``unmapped_names`` -- checkpoint names matching nothing (``learning_rate``, ``momentum``,
      ``global_step``, other optimizers' slots ...), in file order.

    ``rename`` is an optional ``{old prefix: new prefix}`` applied first (e.g. ``{"head.": ""}`` for the
    pipeline tutorial's stem). Floating tensors are cast to the module's dtype. A shape mismatch, and with
    ``strict`` a module tensor the checkpoint lacks, raise :class:`CheckpointError`.
    """
    state = module.state_dict()
    params = dict(module.named_parameters())
    found: dict[str, torch.Tensor] = {}
    momentum_state: dict[str, torch.Tensor] = {}
    unmapped: list[str] = []
    for ms_name, value in ms_tensors.items():
        name = _apply_rename(ms_name, rename)
        is_moment = name.startswith(_MOMENTS)
        torch_name = _ms_to_torch_name(name[len(_MOMENTS):] if is_moment else name)
        target = params.get(torch_name) if is_moment else state.get(torch_name)
        if target is None:
            unmapped.append(ms_name)
            continue
        tensor = _as_tensor(ms_name, value)
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"checkpoint parameter {ms_name!r} has shape {tuple(tensor.shape)} but "
                                  f"{torch_name!r} of the module has shape {tuple(target.shape)}")
        if tensor.dtype != target.dtype:
            if not (tensor.is_floating_point() and target.is_floating_point()):
                raise CheckpointError(f"checkpoint parameter {ms_name!r} has dtype {tensor.dtype} but "
                                      f"{torch_name!r} of the module has dtype {target.dtype}")
            tensor = tensor.to(target.dtype)
        (momentum_state if is_moment else found)[torch_name] = tensor

    missing = [k for k in state if k not in found and not k.endswith("num_batches_tracked")]
    if strict and missing:
        inverse = torch_to_mindspore_names(module)
        shown = ", ".join(f"{inverse.get(k, k)!r}" for k in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s) of the module: {shown}{more} "
                              "(pass strict=False to load the rest)")
    model_state = {k: found[k] if k in found else state[k].clone() for k in state
                   if k in found or k.endswith("num_batches_tracked")}
    return model_state, momentum_state, unmapped


def mindspore_named_tensors(ms_tensors: Mapping[str, Any], *, torch_names: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a MindSpore checkpoint, no module needed: names and dtypes kept exactly (int32, float16 ...),
    so any network's checkpoint converts.

    With ``torch_names``, norm layers' leaves take torch's names -- a prefix holding ``moving_mean`` /
    ``moving_variance`` (BatchNorm) or both ``gamma`` and ``beta`` (LayerNorm, GroupNorm) gets ``weight``, ``bias``,
    ``running_mean``, ``running_var`` (also under ``moments.``), and each BatchNorm a ``num_batches_tracked`` of 0
    (MindSpore has none; torch's strict ``load_state_dict`` wants one). A ``beta`` elsewhere keeps its name.
    """
    leaves: dict[str, set[str]] = {}
    for name in ms_tensors:
        bare = name[len(_MOMENTS):] if name.startswith(_MOMENTS) else name
        prefix, _, leaf = bare.rpartition(".")
        leaves.setdefault(prefix, set()).add(leaf)
    batchnorms = {p for p, ls in leaves.items() if ls & {"moving_mean", "moving_variance"}}
    norms = batchnorms | {p for p, ls in leaves.items() if {"gamma", "beta"} <= ls}
    out: dict[str, torch.Tensor] = {}
    for name, value in ms_tensors.items():
        moment = name.startswith(_MOMENTS)
        bare = name[len(_MOMENTS):] if moment else name
        prefix, dot, leaf = bare.rpartition(".")
        if torch_names and prefix in norms:
            bare = prefix + dot + _MS_TO_TORCH_LEAF.get(leaf, leaf)
        out[(_MOMENTS if moment else "") + bare] = _as_tensor(name, value)
    if torch_names:
        for prefix in sorted(batchnorms):
            out.setdefault(f"{prefix}.num_batches_tracked" if prefix else "num_batches_tracked",
                           torch.zeros((), dtype=torch.int64))
    return out


def _apply_rename(name: str, rename: Mapping[str, str] | None) -> str:
    for old, new in (rename or {}).items():
        if name.startswith(old):
            return new + name[len(old):]
        if name.startswith(_MOMENTS + old):
            return _MOMENTS + new + name[len(_MOMENTS) + len(old):]
    return name


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
        raise CheckpointError(f"checkpoint entry {name!r} is not numeric (dtype {array.dtype})")
    return torch.from_numpy(np.array(array, copy=True))
