"""Turn a network into the thing a training step runs, according to the parallel context.

``prepare(network, loss_fn, optimizer)`` returns a :class:`Prepared`: how to compute the loss of a batch, the
context manager that suppresses gradient communication during accumulation, and the hook that completes the
gradients after backward. One object per mode; the training step never branches on the mode itself.

- STAND_ALONE: the network as is.
- DATA_PARALLEL: torch DDP (:mod:`autopar.parallel.data.replicas`).
- SEMI_AUTO_PARALLEL / AUTO_PARALLEL: layouts on DTensor (:mod:`autopar.parallel.tensor.runtime`); a network
  without any strategy trains exactly as DATA_PARALLEL (it *is* the DATA_PARALLEL path).
- HYBRID_PARALLEL: DDP for ordinary parameters; ``layerwise_parallel`` parameters are this rank's slice, skipped by
  the all-reduce, while the network's own collectives (``ops.AllReduce``) do the rest.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch

from autopar import context as _context
from autopar.comm import management as _comm
from autopar.context import ParallelMode
from autopar.errors import ConfigError
from autopar.labels import call_loss
from autopar.ops.shard import shard  # noqa: F401  (public: autopar.shard)


class _WithLoss(torch.nn.Module):
    """network + loss as one module, so that a parallel runtime sees the loss operators too. ``loss_fn`` is any
    callable: a Module or Cell (registered as a child), a function or a lambda (kept as a plain attribute)."""

    def __init__(self, network: torch.nn.Module, loss_fn: Callable):
        super().__init__()
        self.network = network
        self.loss_fn = loss_fn

    def forward(self, *inputs):
        return call_loss(self.loss_fn, self.network(*inputs[:-1]), inputs[-1])


@dataclass
class Prepared:
    mode: ParallelMode
    network: torch.nn.Module  # the user's network (eval, checkpoints)
    device: torch.device
    world_size: int
    forward_loss: Callable[[list], torch.Tensor]
    no_sync: Callable[[], ContextManager] = field(default=contextlib.nullcontext)
    after_backward: Callable[[], None] = field(default=lambda: None)
    runtime: Any = None  # the SemiAutoRuntime, in the layout modes
    channels_last: bool = False  # feed 4-D inputs in channels-last memory format (parallel.tuning)
    compiled: bool = False  # GRAPH_MODE: the forward runs through torch.compile
    runs_backward: bool = False  # pipeline: forward_loss runs the backward too (and returns the detached loss)
    # pipeline: make every stage's parameters current on every rank (each rank trains only its stage's)
    sync_parameters: Callable[[], None] = field(default=lambda: None)


def has_strategies(*modules: torch.nn.Module | None) -> bool:
    """Does any operator or module carry a shard strategy?"""
    from autopar.ops.math import ShardablePrimitive

    for root in modules:
        if not isinstance(root, torch.nn.Module):  # None, or a loss given as a function
            continue
        for m in root.modules():
            if getattr(m, "_autopar_op", None) is not None:
                return True
            if isinstance(m, ShardablePrimitive) and m.strategy is not None:
                return True
    return False


def _layerwise_names(network: torch.nn.Module) -> list[str]:
    return [n for n, p in network.named_parameters() if getattr(p, "layerwise_parallel", False)]


def _loss_caller(module: torch.nn.Module, loss_fn: torch.nn.Module | None) -> Callable[[list], torch.Tensor]:
    if loss_fn is None:
        return lambda inputs: module(*inputs)
    return lambda inputs: call_loss(loss_fn, module(*inputs[:-1]), inputs[-1])


def prepare(network: torch.nn.Module, loss_fn: torch.nn.Module | None = None,
            optimizer: torch.optim.Optimizer | None = None, mode: ParallelMode | None = None,
            sample: list | None = None) -> Prepared:
    """``sample``: one batch (inputs..., label), needed by AUTO_PARALLEL to plan on real shapes."""
    ctx = _context.auto_parallel_context()
    mode = mode or ctx.parallel_mode
    if mode is not ParallelMode.STAND_ALONE and not _comm.is_initialized():
        raise ConfigError(f"parallel_mode={mode.value} needs the cluster: call autopar.communication.init() first")
    device = _comm.device() if _comm.is_initialized() else torch.device("cpu")
    _to_device(network, device)
    if isinstance(loss_fn, torch.nn.Module):
        loss_fn.to(device)
    from autopar.perf.tuning import tune_allocator

    tune_allocator(network)  # every mode: it changes no result, only how often freed memory is faulted back in
    world = _comm.get_group_size() if _comm.is_initialized() else 1
    if ctx.pipeline_stages > 1:
        if mode is not ParallelMode.STAND_ALONE:
            return _prepare_pipeline(network, loss_fn, mode, device, world, ctx)
        _warn_once("pipeline_stages", f"autopar: pipeline_stages={ctx.pipeline_stages} needs a parallel mode "
                   "(semi_auto_parallel, as MindSpore): stand_alone runs the network in one stage")
    if mode is ParallelMode.STAND_ALONE:
        return _tuned(Prepared(mode, network, device, world, _loss_caller(network, loss_fn)), network, optimizer)
    layerwise = _layerwise_names(network)
    if mode is ParallelMode.AUTO_PARALLEL:
        if layerwise:
            raise ConfigError(f"layerwise_parallel parameters {layerwise} need parallel_mode=hybrid_parallel")
        if runtime_of(network) is None and network.__dict__.get("_autopar_planned_pipeline") is None:
            if sample is None:
                raise ConfigError("AUTO_PARALLEL plans on a batch: give Model.train a dataset (or call the network)")
            from autopar.planner.api import plan_and_apply

            plan_and_apply(network, loss_fn, sample)
        if network.__dict__.get("_autopar_planned_pipeline") is not None:
            return _prepare_planned_pipeline(network, loss_fn, mode, device, world, ctx)
        if has_strategies(network, loss_fn) or runtime_of(network) is not None:
            return _prepare_layouts(network, loss_fn, optimizer, mode, device, world, ctx)
        return _tuned(_prepare_data_parallel(network, loss_fn, mode, device, world, ctx, layerwise), network, optimizer)
    if mode is ParallelMode.SEMI_AUTO_PARALLEL and layerwise:
        raise ConfigError(f"layerwise_parallel parameters {layerwise} need parallel_mode=hybrid_parallel")
    if mode is ParallelMode.SEMI_AUTO_PARALLEL and (has_strategies(network, loss_fn) or ctx.strategy_ckpt_load_file
                                                   or runtime_of(network) is not None):
        return _prepare_layouts(network, loss_fn, optimizer, mode, device, world, ctx)
    return _tuned(_prepare_data_parallel(network, loss_fn, mode, device, world, ctx, layerwise), network, optimizer)


def _tuned(prepared: Prepared, network: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Prepared:
    """The measured speed defaults (``parallel.tuning``) and GRAPH_MODE, for the modes that run the user's modules
    as they are (stand-alone, data and hybrid parallel). The layout modes run operators on DTensor shards through
    hooks, which neither channels-last nor torch.compile's graph capture are known to keep exact: they stay eager."""
    from autopar.perf import tuning

    prepared.channels_last = tuning.tune_network(network)
    tuning.tune_optimizer(optimizer)
    if _context.run_context().mode == _context.GRAPH_MODE:
        from autopar.perf.graph_mode import compile_forward

        prepared.forward_loss = compile_forward(prepared.forward_loss)
        prepared.compiled = True
    return prepared


def _prepare_data_parallel(network, loss_fn, mode, device, world, ctx, layerwise) -> Prepared:
    # AUTO_PARALLEL chose data parallel with ZeRO, or parallelize(zero=...) sharded it already
    planned = network.__dict__.get("_autopar_zero_level") or network.__dict__.get("_autopar_zero")
    if planned or _zero_level(ctx, mode):
        from autopar.parallel.zero import fsdp as optimizer_shard

        _shard_optimizer(network, ctx, planned)
        return Prepared(mode, network, device, world, _loss_caller(network, loss_fn),
                        no_sync=lambda: optimizer_shard.no_sync(network))
    from autopar.parallel.data.replicas import wrap_data_parallel
    from autopar.parallel.grads.layouts import sync_of

    if sync_of(network) is not None:  # a plain loop trained it first: its hooks complete the gradients already
        return Prepared(mode, network, device, world, _loss_caller(network, loss_fn))
    network.__dict__["_autopar_ddp"] = True  # a plain loop that calls it later must leave Model's steps to DDP
    ignored = set(layerwise)
    trainable = [n for n, p in network.named_parameters() if p.requires_grad and n not in ignored]
    if trainable:
        from autopar.perf.tuning import current

        ddp = wrap_data_parallel(network, gradients_mean=ctx.gradients_mean, parameter_broadcast=ctx.parameter_broadcast,
                                 device=device, ignore=ignored, bucket_cap_mb=current().bucket_mb,
                                 shared_memory=current().shared_memory
                                 and _context.run_context().mode != _context.GRAPH_MODE)
        module, no_sync = ddp, ddp.no_sync
    else:
        module, no_sync = network, contextlib.nullcontext
    after = (lambda: None)
    if layerwise and ctx.gradients_mean and world > 1:
        params = [p for n, p in network.named_parameters() if n in ignored]

        def after() -> None:
            # The network's own collectives already summed the ranks' contributions: the gradient is that of the
            # sum of the ranks' losses; gradients_mean makes it the mean, as for every other parameter.
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.div_(world)

    return Prepared(mode, network, device, world, _loss_caller(module, loss_fn), no_sync, after)


def _prepare_layouts(network, loss_fn, optimizer, mode, device, world, ctx) -> Prepared:
    from autopar.parallel.tensor.runtime import SemiAutoRuntime

    zero = _zero_level(ctx, mode)
    runtime = runtime_of(network) or SemiAutoRuntime(
        gradients_mean=ctx.gradients_mean, full_batch=ctx.full_batch, parameter_broadcast=ctx.parameter_broadcast,
        strategy_save_file=ctx.strategy_ckpt_save_file, strategy_load_file=ctx.strategy_ckpt_load_file,
        dataset_strategy=ctx.dataset_strategy, zero_level=zero, zero_shard_size=_zero_shard_size(ctx) if zero else None)
    root = network if loss_fn is None else _WithLoss(network, loss_fn)
    runtime.add_root(network)  # first: parameters and operators are named as in the user's network
    runtime.add_root(root)
    runtime.attach_optimizer(optimizer)
    # no after_backward: the parameters' hooks complete the gradients inside the backward (parallel.grad_sync)
    return Prepared(mode, network, device, world, lambda inputs: root(*inputs), runtime=runtime)


def runtime_of(module: torch.nn.Module):
    return getattr(module, "_autopar_runtime", None)


def _layout_mode(network: torch.nn.Module) -> bool:
    """Does ``network`` run on layouts (DTensor) under the current context, or data-parallel?"""
    ctx = _context.auto_parallel_context()
    if ctx.parallel_mode is ParallelMode.AUTO_PARALLEL:
        return True
    return ctx.parallel_mode is ParallelMode.SEMI_AUTO_PARALLEL and (
        has_strategies(network) or bool(ctx.strategy_ckpt_load_file) or runtime_of(network) is not None)


def parallelize(network: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                sample: list | None = None, *, zero: str | int | None = None,
                zero_shard_size: int | None = None) -> torch.nn.Module:
    """Make ``network`` train under the current parallel context when a loop calls it directly -- the PyTorch
    door's one call, like ``fully_shard(model)``. Optional: the first call of the network in a parallel mode does
    it by itself (:mod:`autopar.parallel.entry`). AUTO_PARALLEL plans on ``sample`` (the network's inputs).

    SEMI_AUTO/AUTO lay parameters out as slices on the first forward; DATA/HYBRID (and SEMI_AUTO without any
    strategy) keep them whole. Either way hooks complete the gradients inside every backward, and optimizers --
    made before or after -- are moved onto the parameters that train before their next step.

    ``zero`` (1, 2, 3 or "level1".."level3") shards the optimizer state (and gradients, weights) of this network
    over the data-parallel ranks, ``zero_shard_size`` over groups of that many ranks (hybrid): the PyTorch
    spelling of ``enable_parallel_optimizer`` / ``optimizer_weight_shard_size``, for this network only."""
    if not _comm.is_initialized():
        raise ConfigError("parallelize: call autopar.communication.init() first")
    ctx = _with_zero(_context.auto_parallel_context(), zero, zero_shard_size)
    if ctx.parallel_mode is ParallelMode.STAND_ALONE:
        return network
    _to_device(network, _comm.device())
    inner = _inner_runtime(network)
    if inner is not None and runtime_of(network) is None:
        inner.add_root(network)  # a wrapper (WithLossCell ...) around a network that is already laid out
        inner.attach_optimizer(optimizer)
        return network
    if not _layout_mode(network):
        if _zero_level(ctx, ctx.parallel_mode):
            _shard_optimizer(network, ctx)
        else:
            _attach_data_parallel(network, ctx)
        return network
    layerwise = _layerwise_names(network)
    if layerwise:
        raise ConfigError(f"layerwise_parallel parameters {layerwise} need parallel_mode=hybrid_parallel "
                          f"(now {ctx.parallel_mode.value})")
    if ctx.parallel_mode is ParallelMode.AUTO_PARALLEL and runtime_of(network) is None:
        if sample is None:
            raise ConfigError("AUTO_PARALLEL plans on real shapes: parallelize(network, sample=[inputs...])")
        from autopar.planner.api import plan_and_apply

        plan_and_apply(network, None, sample)
        if network.__dict__.get("_autopar_zero_level"):  # the plan: data parallel with the optimizer sharded
            _shard_optimizer(network, ctx, network.__dict__["_autopar_zero_level"])
            return network
    if runtime_of(network) is None:
        _prepare_layouts(network, None, optimizer, ctx.parallel_mode, _comm.device(), _comm.get_group_size(), ctx)
    elif optimizer is not None:
        runtime_of(network).attach_optimizer(optimizer)
    return network


def _with_zero(ctx, zero, shard_size):
    """The context as seen by one ``parallelize(zero=..., zero_shard_size=...)`` call."""
    if zero is None and shard_size is None:
        return ctx
    import dataclasses

    level = f"level{zero}" if isinstance(zero, int) and not isinstance(zero, bool) else (zero or "level1")
    config = dict(ctx.parallel_optimizer_config or {}, optimizer_level=level)
    if shard_size is not None:
        config["optimizer_weight_shard_size"] = shard_size
    return dataclasses.replace(ctx, enable_parallel_optimizer=True, parallel_optimizer_config=config)


def _to_device(network: torch.nn.Module, device: torch.device) -> None:
    """Move what is not on ``device`` yet (a laid-out parameter is already there and cannot be swapped)."""
    if any(t.device != device for t in [*network.parameters(), *network.buffers()]):
        network.to(device)


def _inner_runtime(network: torch.nn.Module):
    for m in network.modules():
        if runtime_of(m) is not None:
            return runtime_of(m)
    return None


def _attach_data_parallel(network: torch.nn.Module, ctx) -> None:
    """Data/hybrid parallel without a wrapper: replicas made equal once, gradient hooks on every parameter."""
    from autopar.parallel.grads.layouts import GradSync, mark, sync_of

    if sync_of(network) is not None:
        return
    inner = next((sync_of(m) for m in network.modules() if sync_of(m) is not None), None)
    if inner is not None:  # a wrapper around a network whose replicas already agree: same hooks, same sync
        inner.attach_module(network)
        mark(network, inner)
        return
    world = _comm.get_group_size()
    _equalize_replicas(network, ctx, set(_layerwise_names(network)))
    sync = GradSync(world, ctx.gradients_mean, yields_to_ddp=bool(network.__dict__.get("_autopar_ddp")))
    sync.attach_module(network)
    mark(network, sync)


def _equalize_replicas(network: torch.nn.Module, ctx, ignore: set[str]) -> None:
    """``parameter_broadcast``: rank 0's initial values everywhere; otherwise rank 0 warns if the replicas differ."""
    if _comm.get_group_size() <= 1:
        return
    import torch.distributed as dist

    from autopar.parallel.data.replicas import warn_if_replicas_differ

    if ctx.parameter_broadcast:
        with torch.no_grad():
            for name, t in [*network.named_parameters(), *network.named_buffers()]:
                if name not in ignore:
                    dist.broadcast(t.data, src=0)
    else:
        warn_if_replicas_differ(network, ignore)


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        import warnings

        warnings.warn(message, stacklevel=3)


def _prepare_pipeline(network, loss_fn, mode, device, world, ctx) -> Prepared:
    """``pipeline_stages`` > 1: ``Model(nn.PipelineCell(net_with_loss, micro_size), optimizer=opt)`` on torch's
    pipeline engine (:mod:`autopar.parallel.pipeline`)."""
    from autopar.nn.wrappers import PipelineCell, WithLossCell
    from autopar.parallel.pipeline.runner import PipelineParallel, pipeline_of, segments_of, split_points_from_stages

    stages = ctx.pipeline_stages
    if (not isinstance(network, PipelineCell) or loss_fn is not None
            or not isinstance(network.network, WithLossCell)):
        raise ConfigError(f"pipeline_stages={stages} trains Model(nn.PipelineCell(nn.WithLossCell(net, loss), "
                          "micro_size), optimizer=opt): the label meets the loss on the last stage")
    if world % stages:
        raise ConfigError(f"pipeline_stages={stages} does not divide the {world} ranks")
    if has_strategies(network):
        _warn_once("pipeline+strategies", "autopar: shard strategies inside pipeline stages are not applied yet: "
                   "each stage runs whole, replicated over its data-parallel ranks")
    _warn_zero_in_pipeline(ctx)
    backbone, loss = network.network.backbone_network, network.network._loss_fn
    runner = pipeline_of(backbone)
    if runner is None:
        config = dict(ctx.pipeline_config or {})
        unknown = set(config) - {"pipeline_scheduler", "pipeline_interleave"}
        if unknown:
            raise ConfigError(f"pipeline_config: unknown keys {sorted(unknown)}; known: pipeline_scheduler, "
                              "pipeline_interleave")
        segments = segments_of(backbone) if config.get("pipeline_interleave") else 1
        if config.get("pipeline_interleave") and segments == 1:
            _warn_once("pipeline_interleave", "autopar: pipeline_interleave=True but no cell has pipeline_segment: "
                       "one piece per stage (set cell.pipeline_segment = v, as MindSpore)")
        runner = PipelineParallel(backbone, loss, network.micro_size,
                                  split_points_from_stages(backbone, stages, segments),
                                  schedule=str(config.get("pipeline_scheduler", "1f1b")).lower(),
                                  gradients_mean=ctx.gradients_mean, virtual_stages=segments)
    return Prepared(mode, network, device, world, lambda inputs: runner.step(*inputs), runs_backward=True,
                    sync_parameters=runner.gather_parameters)




def _prepare_planned_pipeline(network, loss_fn, mode, device, world, ctx) -> Prepared:
    """AUTO_PARALLEL cut the network into stages (:mod:`autopar.planner.pipeline_plan`): Model's steps run
    on the pipeline engine, as ``pipeline_stages`` does."""
    from autopar.parallel.pipeline.runner import PipelineParallel, pipeline_of

    _warn_zero_in_pipeline(ctx)
    option = network.__dict__["_autopar_planned_pipeline"]
    runner = pipeline_of(network) or PipelineParallel(network, loss_fn, option.micro_batches, option.split_points,
                                                      gradients_mean=ctx.gradients_mean)
    # each rank was given its data-parallel share (the plan is for the global batch): a replica's batch is the
    # shares of its stages' ranks together
    return Prepared(mode, network, device, world, lambda inputs: runner.step(*runner.replica_batch(inputs)),
                    runs_backward=True, sync_parameters=runner.gather_parameters)


def _warn_zero_in_pipeline(ctx) -> None:
    from autopar.parallel.zero.fsdp import level_of

    if level_of(ctx):
        _warn_once("zero+pipeline", "autopar: enable_parallel_optimizer is not applied inside pipeline stages yet: "
                   "each stage keeps its whole optimizer state (a stage already holds only its own parameters)")


def _zero_level(ctx, mode: ParallelMode) -> str | None:
    """The optimizer-sharding level to apply, or None; asked for in a mode that does not shard (hybrid parallel,
    whose layerwise parameters the network reduces itself): warn once."""
    from autopar.parallel.zero.fsdp import level_of

    level = level_of(ctx)
    if level and mode not in (ParallelMode.DATA_PARALLEL, ParallelMode.SEMI_AUTO_PARALLEL,
                              ParallelMode.AUTO_PARALLEL):
        _warn_once(f"zero/{mode.value}", f"autopar: enable_parallel_optimizer shards the optimizer in data_parallel, "
                   f"semi_auto_parallel and auto_parallel; {mode.value} trains with the whole optimizer state on "
                   f"every rank")
        return None
    return level


def _zero_shard_size(ctx) -> int:
    from autopar.parallel.zero.fsdp import shard_size_of

    return shard_size_of(ctx, _comm.get_group_size() if _comm.is_initialized() else 1)


def _shard_optimizer(network: torch.nn.Module, ctx, level: str | None = None) -> None:
    from autopar.parallel.zero.fsdp import is_sharded, shard_optimizer

    if not is_sharded(network):
        _equalize_replicas(network, ctx, set())
        shard_optimizer(network, level or _zero_level(ctx, ctx.parallel_mode), ctx.gradients_mean,
                        _zero_shard_size(ctx))


def finish_gradients(network: torch.nn.Module) -> None:
    """Nothing to do any more -- hooks complete the gradients inside the backward. Kept (a no-op) so that loops
    written for earlier versions, which called it after each backward, stay exact."""


def apply_layouts(network: torch.nn.Module, layouts: Any) -> None:
    """Lay the network's parameters out as ``layouts`` says ({name: Layout or its dict}, or a strategy file)
    before anything runs -- what a checkpoint is loaded into. Replicated entries need nothing."""
    from autopar.layout.layout import Layout
    from autopar.layout.strategy_file import load_strategy_file

    if isinstance(layouts, (str, os.PathLike)):
        layouts = load_strategy_file(str(layouts))
    layouts = {k: v if isinstance(v, Layout) else Layout.from_dict(v) for k, v in dict(layouts).items()}
    sliced = {k: v for k, v in layouts.items() if not v.is_replicated()}
    if not sliced:
        return
    if runtime_of(network) is None:
        mode = _context.auto_parallel_context().parallel_mode
        if mode not in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL):
            raise ConfigError(f"sliced layouts need parallel_mode=semi_auto_parallel or auto_parallel (now {mode.value})")
        network.to(_comm.device())
        _prepare_layouts(network, None, None, mode, _comm.device(), _comm.get_group_size(),
                         _context.auto_parallel_context())
    runtime = runtime_of(network)
    for name, layout in sliced.items():
        runtime.preset_layout(name, layout)
