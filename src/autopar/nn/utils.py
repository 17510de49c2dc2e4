"""``mindspore.nn.utils.no_init_parameters``: build a network without filling its parameters yet.

Inside ``with no_init_parameters():`` every tensor is made on torch's meta device (no memory, no random draws):
parameters from ``initializer(...)`` and the MindSpore layers remember their initializer, torch modules are reset
with their own ``reset_parameters()``. They are materialised -- in place, the same ``Parameter`` objects, so an
optimizer made inside the block keeps working -- when the network is prepared: by
``autopar.parallel.auto_parallel.AutoParallel(net)``, or at the first call of any module, whichever comes first
(:func:`materialize_pending` does it by hand). Parameters are materialised whole on every rank and then laid out by
the parallel runtime as usual: unlike MindSpore, no rank saves the memory of the slices it will not keep.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules import module as _module

from autopar.common.initializer import RECIPE, materialize

_pending: list[tuple[torch.nn.Module, str, bool]] = []  # (module, attribute, is_parameter) made on the meta device
_hook: list = []


class no_init_parameters:
    """``with no_init_parameters(): net = Network(); opt = nn.SGD(net.trainable_params(), 0.01)``."""

    def __enter__(self) -> "no_init_parameters":
        self._device = torch.device("meta")
        self._device.__enter__()
        self._records: list[tuple[torch.nn.Module, str, bool]] = []
        self._handles = [
            _module.register_module_parameter_registration_hook(lambda m, n, p: self._record(m, n, p, True)),
            _module.register_module_buffer_registration_hook(lambda m, n, b: self._record(m, n, b, False)),
        ]
        return self

    def _record(self, module: torch.nn.Module, name: str, tensor: Any, is_param: bool) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
            self._records.append((module, name, is_param))

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._device.__exit__(*exc)
        if exc[0] is None:
            _pending.extend(self._records)
            _install_first_call_hook()


def _install_first_call_hook() -> None:
    if _hook or not _pending:
        return
    def first_call(module: torch.nn.Module, args: tuple) -> None:
        materialize_pending()

    handle = _module.register_module_forward_pre_hook(first_call)
    _module._global_forward_pre_hooks.move_to_end(handle.id, last=False)  # before the parallel runtime's first call
    _hook.append(handle)


def _real(old: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """A tensor object of ``old``'s kind holding ``data``, carrying ``old``'s Python attributes."""
    from autopar.common.tensor import Parameter

    if isinstance(old, Parameter):
        new = Parameter(data, old.name, old.requires_grad, old.layerwise_parallel)
    elif isinstance(old, torch.nn.Parameter):
        new = torch.nn.Parameter(data, old.requires_grad)
    else:
        new = data
    new.__dict__.update({k: v for k, v in old.__dict__.items() if k != RECIPE})
    return new


def materialize_pending() -> int:
    """Give every parameter and buffer made inside ``no_init_parameters`` its real values; returns how many."""
    done = 0
    by_module: dict[int, tuple[torch.nn.Module, list[tuple[str, bool]]]] = {}
    for module, name, is_param in _pending:
        by_module.setdefault(id(module), (module, []))[1].append((name, is_param))
    _pending.clear()
    for handle in _hook:
        handle.remove()
    _hook.clear()
    for module, entries in by_module.values():
        recipes, reset = [], False
        for name, is_param in entries:
            table = module._parameters if is_param else module._buffers
            old = table.get(name)
            if old is None or old.device.type != "meta":
                continue
            recipe = getattr(old, RECIPE, None)
            with torch.device("cpu"):
                data = torch.empty(old.shape, dtype=old.dtype)
            torch.utils.swap_tensors(old, _real(old, data))
            if recipe is None:
                reset = True
            else:
                recipes.append((old, recipe))
            done += 1
        if reset and hasattr(module, "reset_parameters"):
            module.reset_parameters()
        elif reset and hasattr(module, "reset_running_stats"):
            module.reset_running_stats()
        with torch.no_grad():
            for tensor, recipe in recipes:
                tensor.copy_(materialize(recipe))
    return done
