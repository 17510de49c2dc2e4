"""Parameters that a parallel mode replaced, and the optimizers that still hold the originals.

A layout mode lays a parameter out as this rank's slice: a new ``nn.Parameter`` holding a DTensor takes the
original's place in its module (torch's own ``fully_shard`` and ``parallelize_module`` do the same). A user's
optimizer made before that -- ``opt = SGD(net.parameters())`` right after building the network, the most common
PyTorch line -- still holds the originals, which no longer receive gradients: it would train nothing and say
nothing. This registry remembers every replacement; :func:`remap_optimizer` moves an optimizer (its groups and its
state) onto the replacements, and is called before every optimizer step (a global step pre-hook installed by the
parallel layer) and by autopar's own optimizers. It sits at the bottom of the house so that ``nn`` (optimizers,
``value_and_grad``) and ``parallel`` can both use it.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

_replacement: WeakIdKeyDictionary = WeakIdKeyDictionary()  # original parameter -> the one that trains now
_generation = 0  # bumped on every replacement: an optimizer remapped at this generation needs no new look
_seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> the generation it was remapped at


def successor(old: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """A tensor of ``old``'s kind holding ``data``: for a parameter, its class (a MindSpore ``Parameter``), its
    ``requires_grad`` and its attributes (``name``, ``layerwise_parallel``)."""
    if not isinstance(old, torch.nn.Parameter):
        return data
    new = torch.Tensor._make_subclass(type(old), data.detach(), old.requires_grad)
    new.__dict__.update(old.__dict__)
    return new


def record(original: torch.Tensor, replacement: torch.Tensor) -> None:
    global _generation
    _replacement[original] = replacement
    _generation += 1
    for ref in list(_carriers):
        registry = ref()
        if registry is None:
            _carriers.remove(ref)
        elif original in registry and replacement not in registry:
            registry[replacement] = registry[original]


_carriers: list = []  # weak references to registries whose entries follow a parameter to its replacement


def carry(registry: WeakIdKeyDictionary) -> None:
    """What ``registry`` (parameter -> value, weakly keyed) holds for a parameter it also holds for the parameter
    that replaces it: a parallel mode's names of the parameters it will lay out still find one materialised in its
    place (a meta parameter made whole for a checkpoint read before the network's first call)."""
    _carriers.append(weakref.ref(registry))


def resolve(param: torch.Tensor) -> torch.Tensor:
    """The parameter that trains in place of ``param`` (``param`` itself when it was never replaced)."""
    seen = 0
    while param in _replacement and seen < 8:  # a replacement may be replaced again (a layout preset, then reset)
        param = _replacement[param]
        seen += 1
    return param


def remap_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Point ``optimizer``'s groups and state at the replacements of the parameters it holds."""
    if _seen.get(optimizer, -1) == _generation:
        return
    _seen[optimizer] = _generation
    if not len(_replacement):
        return
    for group in optimizer.param_groups:
        params = [resolve(p) for p in group["params"]]
        if any(a is not b for a, b in zip(params, group["params"])):
            group["params"] = params
            from torch.distributed.tensor import DTensor

            kinds = {isinstance(p, DTensor) for p in params}
            if len(kinds) > 1 and group.get("foreach") is not False:
                group["foreach"] = False  # one foreach kernel cannot mix DTensors and plain tensors
    for old in [k for k in list(optimizer.state) if k in _replacement]:
        new = resolve(old)
        state = optimizer.state.pop(old)
        for name, value in state.items():  # e.g. a momentum buffer loaded whole: slice it like its parameter
            if (isinstance(value, torch.Tensor) and hasattr(new, "placements") and not hasattr(value, "placements")
                    and tuple(value.shape) == tuple(new.shape)):
                from torch.distributed.tensor import distribute_tensor

                state[name] = distribute_tensor(value, new.device_mesh, new.placements, src_data_rank=None)
            elif (hasattr(value, "placements") and hasattr(new, "placements") and tuple(value.shape) == tuple(new.shape)
                  and tuple(value.placements) != tuple(new.placements)):  # resumed in one layout, trained in another
                state[name] = value.redistribute(new.device_mesh, new.placements)
        optimizer.state[new] = state
