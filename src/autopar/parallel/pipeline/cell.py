"""MindSpore's door to pipelines: ``Model(nn.PipelineCell(nn.WithLossCell(net, loss), micro_size))`` with
``pipeline_stages`` = S, and AUTO_PARALLEL's planned pipeline -- both on :class:`PipelineParallel`."""
from __future__ import annotations

import warnings

import torch

from autopar.errors import ConfigError, user_stacklevel
from autopar.parallel.pipeline.runner import PipelineParallel, pipeline_of
from autopar.parallel.pipeline.split import segments_of, split_points_from_stages

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=user_stacklevel())


def zero_level_in_pipeline(ctx, replicas: int) -> str | None:
    """``enable_parallel_optimizer`` under pipeline stages: the level each stage shards over its ``replicas``
    data-parallel ranks (MindSpore shards a stage's optimizer over the stage's ranks); None where nothing is to be
    sharded -- said where it was asked for, never silently ignored."""
    from autopar.parallel.zero.fsdp import level_of

    level = level_of(ctx)
    if level is None:
        return None
    if replicas < 2:
        _warn_once("zero+pipeline", "autopar: enable_parallel_optimizer shards nothing here: each pipeline stage has "
                   "one rank (ZeRO shards a stage's optimizer over the stage's data-parallel replicas)")
        return None
    size = dict(ctx.parallel_optimizer_config or {}).get("optimizer_weight_shard_size",
                                                         ctx.optimizer_weight_shard_size)
    if size not in (None, -1, 0, replicas):
        _warn_once("zero+pipeline-shard-size", "autopar: optimizer_weight_shard_size is not applied inside pipeline "
                   f"stages: each stage shards over all of its {replicas} data-parallel replicas")
    return level


def expert_parallel_in_pipeline(network: torch.nn.Module, stages: int, replicas: int) -> int:
    """MindSpore's ``MoEParallelConfig(expert_parallel=N)`` under ``pipeline_stages``: each stage's experts spread
    over each group of N of its data-parallel replicas (``PipelineParallel(ep=N)``) where N divides them; another N
    is said, and the experts run whole on each rank. An ``nn.transformer.MoE``'s ``dropped`` is not counted inside stages (each runs
    the traced network): said too."""
    from autopar.nn.moe import MoE

    if any(isinstance(m, MoE) for m in network.modules()):
        _warn_once("pipeline+moe.dropped", "autopar: MoE.dropped is not counted inside pipeline stages (each stage runs "
                   "the traced network); the capacity still drops the same assignments")
    degrees = {m._autopar_experts for m in network.modules() if getattr(m, "_autopar_experts", False)}
    if not degrees:
        return 1
    if len(degrees) == 1 and True not in degrees:
        degree = next(iter(degrees))
        if degree > 1 and replicas % degree == 0:
            return degree
    given = ", ".join(sorted(str(d) if d is not True else "every rank" for d in degrees))
    _warn_once("pipeline+expert_parallel", f"autopar: expert_parallel={given} is not applied inside pipeline_stages="
               f"{stages}: a stage's experts spread over its {replicas} data-parallel replica(s) or groups of them "
               f"(give an expert_parallel dividing {replicas}); here each stage's experts run whole on each of its "
               "ranks")
    return 1


def attach_pipeline_cell(network: torch.nn.Module, loss_fn, ctx, world: int) -> PipelineParallel:
    """``pipeline_stages`` > 1: the runner of ``nn.PipelineCell(nn.WithLossCell(net, loss), micro_size)`` -- in
    ``Model`` or called inside ``value_and_grad`` -- split before the first cell of each stage
    (``cell.pipeline_stage``); the micro-batches' losses summed, as MindSpore's."""
    from autopar.nn.wrappers import PipelineCell, WithLossCell
    from autopar.ops.shard import has_strategies

    stages = ctx.pipeline_stages
    if (not isinstance(network, PipelineCell) or loss_fn is not None
            or not isinstance(network.network, WithLossCell)):
        raise ConfigError(f"pipeline_stages={stages} trains nn.PipelineCell(nn.WithLossCell(net, loss), micro_size) "
                          "(in Model(cell, optimizer=opt) or value_and_grad): the label meets the loss on the last "
                          "stage")
    if world % stages:
        raise ConfigError(f"pipeline_stages={stages} does not divide the {world} ranks")
    from autopar.parallel.tensor.inputs import splits_sequence

    if splits_sequence(ctx.dataset_strategy):  # each rank would be given a slice the stages take for a whole batch
        raise ConfigError(f"dataset_strategy={ctx.dataset_strategy} splits the sequence (context parallelism), which "
                          f"pipeline_stages={stages} does not run through this door yet: the PyTorch door does "
                          "(PipelineParallel(..., grads='stage', cp=N), each rank given its replica's whole batch)")
    # the operators' strategies split the stages' weights over a tensor group, and cells split on the sequence run
    # on its slices there (read by the trace: stage_strategies)
    strategies = has_strategies(network, experts=False)
    backbone, loss = network.network.backbone_network, network.network._loss_fn
    runner = pipeline_of(backbone)
    if runner is not None:
        return runner
    config = dict(ctx.pipeline_config or {})
    unknown = set(config) - {"pipeline_scheduler", "pipeline_interleave"}
    if unknown:
        raise ConfigError(f"pipeline_config: unknown keys {sorted(unknown)}; known: pipeline_scheduler, "
                          "pipeline_interleave")
    segments = segments_of(backbone) if config.get("pipeline_interleave") else 1
    if config.get("pipeline_interleave") and segments == 1:
        _warn_once("pipeline_interleave", "autopar: pipeline_interleave=True but no cell has pipeline_segment: "
                   "one piece per stage (set cell.pipeline_segment = v, as MindSpore)")
    ep = expert_parallel_in_pipeline(backbone, stages, world // stages)
    with warnings.catch_warnings():  # (experts marked and not spread: said above, in this door's words)
        warnings.filterwarnings("ignore", message="autopar: expert parallelism marked")
        return PipelineParallel(backbone, loss, network.micro_size,
                                split_points_from_stages(backbone, stages, segments),
                                schedule=str(config.get("pipeline_scheduler", "1f1b")).lower(),
                                gradients_mean=ctx.gradients_mean, virtual_stages=segments, grads="stage",
                                reduction="sum", zero=zero_level_in_pipeline(ctx, world // stages), ep=ep,
                                from_strategies=strategies)


def attach_planned_pipeline(network: torch.nn.Module, loss_fn, option, ctx) -> PipelineParallel:
    """AUTO_PARALLEL cut the network into stages (:mod:`autopar.planner.pipeline_plan`): Model's steps run on the
    pipeline engine, as ``pipeline_stages`` does; each rank holds its data-parallel share of the global batch (a
    replica's batch is the shares of its stages' ranks together: ``runner.replica_batch``)."""
    import torch.distributed as dist

    zero = zero_level_in_pipeline(ctx, dist.get_world_size() // option.stages)
    return pipeline_of(network) or PipelineParallel(network, loss_fn, option.micro_batches, option.split_points,
                                                    gradients_mean=ctx.gradients_mean, grads="stage", zero=zero)
