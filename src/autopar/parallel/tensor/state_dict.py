"""``net.state_dict()`` of a network whose parameters are laid out as slices: full tensors, as a module gives.

A user who saves ``net.state_dict()`` with ``torch.save`` and later loads it into the same network (or into a
plain one) expects whole tensors, whatever the parallel mode. Each module that owns a sliced parameter gets two
hooks: its state dict gathers the slices (every rank calls ``state_dict()``, as every rank runs the loop), and
``load_state_dict`` of full tensors keeps this rank's slice. autopar's own sliced checkpoints need the slices
themselves: they read the state dict inside :func:`sharded_state_dict`.
"""
from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.context import ScopedFlag

# State dicts read inside ``with sharded_state_dict():`` keep DTensor slices (what DCP saves and loads).
sharded_state_dict = ScopedFlag()
_sharded = sharded_state_dict.on


def _gather(module, state_dict, prefix, local_metadata) -> None:
    if _sharded():
        return
    for attr in module._parameters:
        value = state_dict.get(prefix + attr)
        if isinstance(value, DTensor):
            state_dict[prefix + attr] = value.full_tensor().detach()


def _slice(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    for attr, p in module._parameters.items():
        key = prefix + attr
        value = state_dict.get(key)
        if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                and tuple(value.shape) == tuple(p.shape):
            state_dict[key] = distribute_tensor(value.detach().to(p.device, p.dtype), p.device_mesh, p.placements,
                                                src_data_rank=None)


_hooked: weakref.WeakSet = weakref.WeakSet()


def install(module: torch.nn.Module) -> None:
    """Hooks on ``module``, which owns (or will own) a sliced parameter; once per module."""
    if module in _hooked:
        return
    _hooked.add(module)
    module.register_state_dict_post_hook(_gather)
    module.register_load_state_dict_pre_hook(_slice)
