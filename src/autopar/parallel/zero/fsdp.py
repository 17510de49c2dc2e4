"""Optimizer sharding -- MindSpore's ``enable_parallel_optimizer`` (ZeRO) -- on torch's FSDP2 (``fully_shard``).

``set_auto_parallel_context(parallel_mode="data_parallel", enable_parallel_optimizer=True,
parallel_optimizer_config={"optimizer_level": "level1" | "level2" | "level3"})``: every parameter is stored as this
rank's 1/N slice (a DTensor sharded on dimension 0), so the optimizer state made on it is 1/N too; gradients are
reduce-scattered straight into slices; each module's parameters are all-gathered just for its own compute.

- level1 / level2: parameters stay gathered from the forward to the backward (``reshard_after_forward=False``): the
  optimizer state and gradients are sharded, the communication volume is DDP's (an all-reduce = reduce-scatter +
  all-gather). FSDP2 has no mode that shards the optimizer state alone, so level1 also shards the gradients: more
  memory saved for the same traffic.
- level3: parameters are gathered again for the backward (``reshard_after_forward=True``): ZeRO-3, weights sharded
  between uses too, one more all-gather per layer.

Why FSDP2 and not ``ZeroRedundancyOptimizer``: FSDP2's slices are DTensors, which the rest of autopar already speaks
(the optimizer remapping of :mod:`autopar.common.replaced`, full-tensor ``state_dict``, DCP sliced checkpoints that
reload onto any world size); ``ZeroRedundancyOptimizer`` keeps whole parameters on every rank (no weight or gradient
saving) and its state dict must be consolidated on one rank, which DCP does not read.

``optimizer_weight_shard_size=s`` (MindSpore's key, in the context or the config): each parameter is sharded over
groups of ``s`` consecutive ranks and replicated across the groups -- FSDP2's hybrid sharding (HSDP) on a
``(world/s, s)`` mesh: gradients reduce-scattered inside a group, then all-reduced across groups. Less memory saved
than sharding over every rank, less of the traffic on the slower links between groups.

In the layout modes (SEMI_AUTO / AUTO) the same levels shard each laid-out parameter over the mesh axes where its
layout replicates it (:func:`storage_placements`, applied by the layout runtime), so a tensor-parallel weight is
split by its strategy and then by ZeRO over the data-parallel ranks. Levels 1-2 keep a gathered copy from the forward
to the backward; level 3 frees it and gathers again for the backward (:mod:`autopar.parallel.tensor.regather`).

Exact: the same data gives the same parameters as DATA_PARALLEL (gradients averaged with ``gradients_mean``, summed
without, as MindSpore).
"""
from __future__ import annotations

import contextlib
import math
import warnings

import torch

from autopar.common import replaced as _replaced
from autopar.errors import ConfigError, user_stacklevel

LEVELS = {"level1": False, "level2": False, "level3": True}  # -> reshard_after_forward
_KNOWN_KEYS = {"optimizer_level", "optimizer_weight_shard_size", "parallel_optimizer_threshold",
               "gradient_accumulation_shard"}


def level_of(ctx) -> str | None:
    """The ZeRO level the context asks for, or None (no sharding). Keys it cannot honour warn."""
    if not ctx.enable_parallel_optimizer:
        return None
    config = dict(ctx.parallel_optimizer_config or {})
    unknown = set(config) - _KNOWN_KEYS
    if unknown:
        raise ConfigError(f"parallel_optimizer_config: unknown keys {sorted(unknown)}; known: {sorted(_KNOWN_KEYS)}")
    level = config.get("optimizer_level", "level1")
    if level not in LEVELS:
        raise ConfigError(f"parallel_optimizer_config optimizer_level={level!r}; expected one of {sorted(LEVELS)}")
    if config.get("parallel_optimizer_threshold") not in (None, 0):
        warnings.warn("parallel_optimizer_threshold is not applied: every parameter is sharded", stacklevel=user_stacklevel())
    if config.get("gradient_accumulation_shard"):
        warnings.warn("gradient_accumulation_shard=True is not applied: accumulated gradients stay whole until the "
                      "last micro-batch reduce-scatters them", stacklevel=user_stacklevel())
    return level


def shard_size_of(ctx, world: int) -> int:
    """How many ranks one parameter is sharded over: ``optimizer_weight_shard_size`` (config first, then the
    context's key), all ``world`` ranks when unset (-1, 0 or None). A size that does not divide the ranks is an
    error."""
    config = dict(ctx.parallel_optimizer_config or {})
    size = config.get("optimizer_weight_shard_size", ctx.optimizer_weight_shard_size)
    if size in (None, -1, 0):
        return world
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"optimizer_weight_shard_size must be a positive integer (or -1: all ranks), got {size!r}")
    if size > world or world % size:
        raise ConfigError(f"optimizer_weight_shard_size={size} must divide the {world} data-parallel ranks")
    return size


def hybrid_mesh(shard_size: int):
    """All ranks on one axis (``shard_size`` = world), or ``(world / shard_size, shard_size)``: replicate across
    the groups, shard inside each group of consecutive ranks."""
    from autopar.comm.topology import dp_mesh

    return dp_mesh(shard_size)


def storage_placements(layout_placements: tuple, shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                       shard_size: int | None = None) -> tuple:
    """Where a laid-out parameter is stored under ZeRO: its layout's placements with the replicated mesh axes
    (the innermost ones covering ``shard_size`` ranks; all when None) turned into ``Shard(d)`` of one dimension
    ``d`` that no other axis splits -- the largest that divides evenly, else the largest that is at least as
    large as the group. A parameter with no such dimension (a scalar) stays as its layout says. The runtime
    redistributes from here to the layout on each use: an all-gather forward, a reduce-scatter of the gradient
    backward (DTensor's own autograd)."""
    from torch.distributed.tensor import Replicate, Shard

    replicated = [m for m, p in enumerate(layout_placements) if isinstance(p, Replicate)]
    chosen: list[int] = []
    for m in reversed(replicated):  # innermost axes first: groups of consecutive ranks, as MindSpore's shard groups
        group = math.prod(mesh_shape[a] for a in chosen)
        if shard_size is not None and group * mesh_shape[m] > shard_size:
            continue
        chosen.append(m)
    group = math.prod(mesh_shape[a] for a in chosen)
    if not chosen or group == 1:
        return tuple(layout_placements)
    taken = {p.dim for p in layout_placements if isinstance(p, Shard)}
    free = [d for d in range(len(shape)) if d not in taken]
    even = [d for d in free if shape[d] % group == 0]
    fits = [d for d in free if shape[d] >= group]
    dims = even or fits
    if not dims:
        return tuple(layout_placements)
    d = max(dims, key=lambda k: (shape[k], -k))
    out = list(layout_placements)
    for m in chosen:
        out[m] = Shard(d)
    return tuple(out)


class ShardedGrads:
    """The seam's view of ZeRO: FSDP2 reduce-scatters the gradients itself, from its own hooks."""

    name = "ZeRO (FSDP2 reduce-scatter)"
    needs_backward = True  # the shards' gradients come from FSDP2's post-backward hooks, never from autograd.grad

    def __init__(self, network: torch.nn.Module):
        from autopar.parallel.grads.engine import claim

        self.network = network
        claim(self, network.parameters())

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: the micro-batches before the last keep unsharded local gradients."""
        self.network.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.network.set_requires_gradient_sync(True)

    def complete_returned(self, params, grads):
        from autopar.errors import TrainingError

        raise TrainingError("torch.autograd.grad cannot differentiate ZeRO's sharded parameters (FSDP2 gathers "
                            "others for the forward): use loss.backward(), or autopar's value_and_grad, which does")

    def close(self) -> None:
        from autopar.parallel.grads.engine import release

        release(self)


def shard_optimizer(network: torch.nn.Module, level: str, gradients_mean: bool, shard_size: int | None = None
                    ) -> None:
    """Shard ``network`` in place: every module owning trainable parameters gets its own FSDP2 group (gathered
    only while it computes), the network the rest -- among them the parameters several modules share (a tied
    embedding and output head: one parameter is managed by one group); over all ranks, or hybrid (HSDP) over
    groups of ``shard_size``. Replaced parameters are recorded, so optimizers made before are moved onto the slices
    before their next step; ``state_dict()`` gives full tensors, as the network's did (autopar's sliced checkpoints
    read the slices)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from autopar.comm.topology import world_size
    from autopar.planner.fsdp_timer import zero_groups

    before = dict(network.named_parameters())
    mesh = hybrid_mesh(shard_size or world_size())
    reshard = LEVELS[level]
    for module in reversed(zero_groups(network)):  # innermost first, as fully_shard wants
        if not isinstance(module, FSDPModule):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(network, mesh=mesh, reshard_after_forward=reshard)
    lazy = {name: p for name, p in before.items() if p.is_meta}
    if lazy:
        _fill_shards(network, lazy, mesh.device_type)
    if not gradients_mean:  # MindSpore's default sums gradients over the ranks; FSDP averages
        for module in network.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM: plain SUM, no scaling
    after = dict(network.named_parameters())
    for name, old in before.items():
        if after.get(name) is not None and after[name] is not old:
            _replaced.record(old, after[name])
    from torch.distributed.tensor import DTensor

    from autopar.parallel.tensor import state_dict as _state_dict

    for module in network.modules():
        if any(isinstance(p, DTensor) for p in module._parameters.values()):
            _state_dict.install(module)
    handle = []

    def after_first_forward(module, args, output):
        _record_unsharded(network)
        handle.pop().remove()

    handle.append(network.register_forward_hook(after_first_forward))


def _fill_shards(network: torch.nn.Module, lazy: dict, device_type: str) -> None:
    """A network built on the meta device (``deferred_init``, ``no_init_parameters``), sharded there: memory for
    the shards only (FSDP2's ``to_empty``), then each shard filled with its slice of the parameter's recorded value
    -- one whole parameter at a time, never the model."""
    from autopar.common import deferred

    _allocate_shards(network, device_type)
    after = dict(network.named_parameters())
    with torch.no_grad():
        for name, old in lazy.items():
            new = after[name]
            new.to_local().copy_(deferred.slice_of(old, new.device_mesh, new.placements))


def _allocate_shards(network: torch.nn.Module, device_type: str) -> None:
    """FSDP2's ``to_empty`` for the meta shards alone: each gets an empty shard of its own, registered where the
    parameter was (tied ones too) and adopted by FSDP (``reset_sharded_param``, the path of
    ``load_state_dict(assign=True)``) -- no tensor swapped in place, which a dry run's fake tensors refuse."""
    from torch.distributed.fsdp import FSDPModule

    for module in network.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            info = fsdp_param._module_info
            old = getattr(info.module, info.param_name)
            if not old.is_meta:
                continue
            new = torch.nn.Parameter(torch.empty_like(old, device=device_type), requires_grad=old.requires_grad)
            for owner, name in [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]:
                owner._parameters[name] = new
            fsdp_param.reset_sharded_param()


def _record_unsharded(network: torch.nn.Module) -> None:
    """Between a forward and its backward a module's registered parameters are the gathered (unsharded) ones: an
    optimizer made right then holds them. Record each as replaced by its shard, so such an optimizer is moved onto
    the shards before it steps (FSDP2 reuses the gathered parameter objects on every step)."""
    from torch.distributed.fsdp import FSDPModule

    for module in network.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    gathered = getattr(fsdp_param, "_unsharded_param", None)
                    if gathered is not None:
                        _replaced.record(gathered, fsdp_param.sharded_param)


def enter_first_call(network: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> tuple:
    """The network was sharded inside its own first call, after torch read its forward pre-hooks: run FSDP's root
    pre-forward (lazy init, gather the root's parameters) by hand, once. Its post-forward hook is read after the
    forward and runs by itself. ``kwargs``: the call's keyword inputs, converted in place."""
    state = network._get_fsdp_state()
    args, new_kwargs = state._pre_forward(network, args, dict(kwargs or {}))
    if kwargs is not None and new_kwargs is not None:
        kwargs.update(new_kwargs)
    return args


