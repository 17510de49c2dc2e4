"""The one dispatch: what a network becomes under the parallel context, decided once.

:func:`attach` reads the context and the network and gives it a :class:`~autopar.parallel.state.ParallelState`:

- STAND_ALONE: the network as is (the speed levers of :mod:`autopar.perf` still apply);
- ``pipeline_stages`` > 1 (MindSpore's ``nn.PipelineCell`` through ``Model``): torch's pipeline engine
  (:mod:`autopar.parallel.pipeline`);
- AUTO_PARALLEL: the planner (:mod:`autopar.planner`) chooses -- data parallel, with ZeRO, layouts, or a pipeline --
  and returns its plan; what it chose is applied here as a user would have written it;
- SEMI_AUTO / AUTO with strategies (or a strategy file): layouts on DTensor (:mod:`autopar.parallel.tensor`);
- ``enable_parallel_optimizer``: ZeRO on FSDP2 (:mod:`autopar.parallel.zero`);
- otherwise -- DATA_PARALLEL, HYBRID, SEMI_AUTO without strategies -- data parallel: replicas made equal, replicated
  parameters summed by the bucketed reducer (:mod:`autopar.parallel.grads.buckets`), HYBRID's layerwise slices left
  to the network's own collectives.

Every trainable parameter gets exactly one gradient engine; every loop (plain torch, ``TrainOneStepCell``,
``value_and_grad``, ``Model``) then runs it from the autograd graph. ``parallelize`` is the PyTorch door's explicit
call; a network's first call in a parallel mode makes it by itself (:mod:`autopar.parallel.entry`); ``Model`` calls
:func:`prepare`, which adds how to compute a batch's loss.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from autopar import context as _context
from autopar.comm import management as _comm
from autopar.context import ParallelMode
from autopar.errors import ConfigError, user_stacklevel
from autopar.labels import call_loss
from autopar.ops.shard import has_strategies, shard  # noqa: F401  (public: autopar.shard)
from autopar.parallel.seeds import same_draws_everywhere
from autopar.parallel.state import ParallelState, bind, state_of, state_within


class _WithLoss(torch.nn.Module):
    """network + loss as one module, so that the layout runtime sees the loss operators too. ``loss_fn`` is any
    callable: a Module or Cell (registered as a child), a function or a lambda (kept as a plain attribute)."""

    def __init__(self, network: torch.nn.Module, loss_fn: Callable):
        super().__init__()
        self.network = network
        self.loss_fn = loss_fn

    def forward(self, *inputs):
        return call_loss(self.loss_fn, self.network(*inputs[:-1]), inputs[-1])


@dataclass
class Prepared:
    """What ``Model``'s steps need: the network's state and how to compute the loss of a batch."""

    state: ParallelState
    network: torch.nn.Module  # the user's network (eval, checkpoints)
    device: torch.device
    forward_loss: Callable[[list], torch.Tensor]
    runs_backward: bool = False  # pipeline: forward_loss runs the backward too (and returns the detached loss)
    sync_parameters: Callable[[], None] = field(default=lambda: None)  # pipeline: every stage current everywhere

    @property
    def mode(self) -> ParallelMode:
        return self.state.mode

    @property
    def world_size(self) -> int:
        return self.state.world

    @property
    def runtime(self):
        return self.state.runtime

    @property
    def channels_last(self) -> bool:
        return self.state.channels_last

    def no_sync(self):
        return self.state.no_sync()


def layerwise_names(network: torch.nn.Module) -> list[str]:
    return [n for n, p in network.named_parameters() if getattr(p, "layerwise_parallel", False)]


def runtime_of(module: torch.nn.Module):
    state = state_of(module)
    return state.runtime if state is not None else None


# -- the dispatch ---------------------------------------------------------------------------------------------------
def attach(network: torch.nn.Module, loss_fn: Any = None, optimizer: torch.optim.Optimizer | None = None,
           sample: list | None = None, ctx=None, sample_kwargs: dict | None = None, plan=None) -> ParallelState:
    """Parallelize ``network`` under ``ctx`` (the current context by default), once: later calls return its state.

    ``sample``: one batch of the network's inputs (and the label, with ``loss_fn``), which AUTO_PARALLEL plans on;
    ``sample_kwargs``: its keyword inputs (``input_ids=..., labels=...``).
    ``plan``: AUTO_PARALLEL's decision, already made (the measured round applies each candidate to a copy)."""
    state = state_of(network)
    if state is not None:
        if state.runtime is not None:
            state.runtime.attach_optimizer(optimizer)
        return state
    ctx = ctx or _context.auto_parallel_context()
    mode = ctx.parallel_mode
    if mode is not ParallelMode.STAND_ALONE and not _comm.is_initialized():
        raise ConfigError(f"parallel_mode={mode.value} needs the cluster: call autopar.communication.init() first")
    world = _comm.get_group_size() if _comm.is_initialized() else 1
    inner = state_within(network)
    if inner is not None:  # a wrapper (WithLossCell ...) around a network parallelized before: the same state
        bind(inner, network)
        if inner.runtime is not None:
            inner.runtime.add_root(network)
            inner.runtime.attach_optimizer(optimizer)
        return inner
    _prepare_deferred(network, loss_fn, ctx)
    _to_device(network, _device())
    if isinstance(loss_fn, torch.nn.Module):
        loss_fn.to(_device())
    from autopar.perf import tuning

    tuning.tune_allocator(network, _device())  # every mode: it changes no result, only how often freed memory is faulted in
    state = bind(ParallelState(mode, world), network)
    try:
        _dispatch(state, network, loss_fn, optimizer, sample, ctx, sample_kwargs or {}, plan)
    except BaseException:
        state.close()
        raise
    if state.runtime is None and state.pipeline is None:  # layouts run ops on shards: they stay as they are
        state.channels_last = tuning.tune_network(network)
        tuning.tune_optimizer(optimizer)
    # a layout runtime says it after its first forward, when the layouts are known; a pipeline whose strategies
    # split its stages, after the trace that reads them
    if state.runtime is None and not getattr(state.pipeline, "from_strategies", False):
        from autopar.parallel.summary import announce

        announce(state, network)
    return state


def _dispatch(state: ParallelState, network, loss_fn, optimizer, sample, ctx, sample_kwargs, plan=None) -> None:
    mode = state.mode
    if ctx.pipeline_stages > 1:
        if mode is not ParallelMode.STAND_ALONE:  # (a network built on the meta device: each stage makes its own)
            from autopar.parallel.pipeline.cell import attach_pipeline_cell

            state.pipeline = attach_pipeline_cell(network, loss_fn, ctx, state.world)
            return
        _whole(network)
        _warn_once("pipeline_stages", f"autopar: pipeline_stages={ctx.pipeline_stages} needs a parallel mode "
                   "(semi_auto_parallel, as MindSpore): stand_alone runs the network in one stage")
    if mode is ParallelMode.STAND_ALONE:
        _whole(network)
        return
    _check_context_parallel(ctx, mode)
    layerwise = layerwise_names(network)
    if layerwise and mode in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL):
        raise ConfigError(f"layerwise_parallel parameters {layerwise} need parallel_mode=hybrid_parallel "
                          f"(now {mode.value})")
    zero = _zero_level(ctx, mode)
    if mode is ParallelMode.AUTO_PARALLEL:  # strategies a user gave are kept: the planner chooses the rest
        if sample is None and not sample_kwargs:
            raise ConfigError("AUTO_PARALLEL plans on real shapes: give Model.train a dataset, or call the network "
                              "(or parallelize(network, sample=[inputs...]))")
        from autopar.common import deferred
        from autopar.planner.plan import MetaTraceError, built_on_meta

        meta = built_on_meta(network)  # (planned as it is: each rank then makes only what the plan keeps)
        if not meta:
            _whole(network)  # the planner measures the network's operators on real values
        try:  # (meta-built: whatever the planning calls -- the calibration's probes too -- makes none of it real)
            with deferred.calls_keep_meta() if meta else contextlib.nullcontext():
                state.plan = plan if plan is not None else _plan(network, loss_fn, optimizer, list(sample or ()),
                                                                 sample_kwargs)
        except MetaTraceError as exc:  # a forward meta tensors cannot trace (sizes set by values)
            _warn_once("auto-meta", f"autopar: AUTO_PARALLEL cannot trace this meta-built network on meta tensors "
                       f"({exc}): it is built whole on every rank to be planned")
            deferred.forget_loaded(network)  # planned on its initial values: a resume's checkpoint then reads over them
            _whole(network)
            state.plan = _plan(network, loss_fn, optimizer, list(sample or ()), sample_kwargs)
        if state.plan.pipeline is not None:
            from autopar.parallel.pipeline.cell import attach_planned_pipeline

            state.pipeline = attach_planned_pipeline(network, loss_fn, state.plan.pipeline, ctx)
            return
        if state.plan.pure_data_parallel:
            zero = state.plan.zero_level or zero
        for target, strategy in state.plan.strategies():
            shard(target, strategy)
    cp = state.plan.context_parallel if mode is ParallelMode.AUTO_PARALLEL and state.plan is not None else 1
    if mode is ParallelMode.AUTO_PARALLEL and cp == 1 and ctx.context_parallel_algo != "all_gather":
        _warn_once("context_parallel_algo", f"autopar: context_parallel_algo={ctx.context_parallel_algo!r} is not "
                   "applied: AUTO_PARALLEL's plan does not split the sequence")
    if cp > 1 or (has_strategies(network, loss_fn) if mode is ParallelMode.AUTO_PARALLEL
                  else lays_out(network, loss_fn, ctx)):
        # the user's context_parallel_algo where they gave one, else the one AUTO's plan weighed its split with
        algo = state.plan.context_parallel_algo if cp > 1 and not _context.given_by_user("context_parallel_algo") \
            else ctx.context_parallel_algo
        _attach_layouts(state, network, loss_fn, optimizer, ctx, zero, cp, algo)
    elif zero:
        from autopar.parallel.data.replicas import equalize_replicas
        from autopar.parallel.zero.fsdp import ShardedGrads, shard_optimizer, shard_size_of

        equalize_replicas(network, ctx.parameter_broadcast)
        shard_optimizer(network, zero, ctx.gradients_mean, shard_size_of(ctx, state.world))
        state.zero_level = zero
        state.engines.append(ShardedGrads(network))
    else:
        _whole(network)
        _attach_data_parallel(state, network, ctx, set(layerwise))


def _prepare_deferred(network: torch.nn.Module, loss_fn: Any, ctx) -> None:
    """A network built on the meta device (``autopar.deferred_init``, ``nn.utils.no_init_parameters``, a plain
    ``torch.device("meta")``): its buffers and frozen parameters made whole now (the forward reads them as they are);
    its trainable parameters stay meta for the mode to materialise -- ZeRO's shards and the layouts' slices only
    what this rank keeps, the other modes whole."""
    from autopar.common import deferred

    for module in (network, loss_fn):
        if isinstance(module, torch.nn.Module) and deferred.has_meta(module):
            deferred.record_initialisers(module)
            same_draws_everywhere(module, ctx.parameter_broadcast)
            deferred.materialize_module(module, device=_device(), frozen_only=True)
    if isinstance(loss_fn, torch.nn.Module):
        _whole(loss_fn)


def _whole(network: torch.nn.Module) -> None:
    from autopar.common import deferred

    deferred.make_whole(network, device=_device())


def lays_out(network, loss_fn, ctx) -> bool:
    """Will ``network`` run on layouts (or be planned, in AUTO) rather than data-parallel?"""
    if ctx.parallel_mode is ParallelMode.AUTO_PARALLEL:
        return True
    return ctx.parallel_mode is ParallelMode.SEMI_AUTO_PARALLEL and (has_strategies(network, loss_fn)
                                                                     or bool(ctx.strategy_ckpt_load_file)
                                                                     or splits_the_sequence(ctx))


def _check_context_parallel(ctx, mode) -> None:
    """A sequence split runs in SEMI_AUTO_PARALLEL (its layouts carry the tokens' places): elsewhere each rank would
    train its slice as if it were a whole sequence -- one line. ``context_parallel_algo`` without one: said."""
    if splits_the_sequence(ctx) and mode in (ParallelMode.DATA_PARALLEL, ParallelMode.HYBRID_PARALLEL):
        raise ConfigError(f"dataset_strategy={ctx.dataset_strategy} splits the sequence (context parallelism), which "
                          f"runs in parallel_mode='semi_auto_parallel' (now {mode.value}): each rank would attend "
                          "only within its own slice")
    if ctx.context_parallel_algo != "all_gather" and not splits_the_sequence(ctx) and \
            mode is not ParallelMode.AUTO_PARALLEL:  # (AUTO may split the sequence itself: said after its plan)
        _warn_once("context_parallel_algo", f"autopar: context_parallel_algo={ctx.context_parallel_algo!r} is not "
                   "applied: no dataset_strategy splits the sequence (e.g. ((dp, cp), (dp, cp)))")


def splits_the_sequence(ctx) -> bool:
    """``dataset_strategy`` splitting the inputs' dimension 1 (the sequence): context parallelism."""
    from autopar.parallel.tensor.inputs import splits_sequence

    return splits_sequence(ctx.dataset_strategy)


def _attach_layouts(state, network, loss_fn, optimizer, ctx, zero, context_parallel: int = 1,
                    algo: str | None = None) -> None:
    """``context_parallel``: AUTO's sequence split over this many ranks (the batch, loaded as for data parallel,
    re-split on the way in); ``algo``: how attention meets the split keys (AUTO's choice; else the context's
    ``context_parallel_algo``)."""
    from autopar.parallel.tensor.runtime import SemiAutoRuntime
    from autopar.parallel.zero.fsdp import shard_size_of

    runtime = SemiAutoRuntime(
        gradients_mean=ctx.gradients_mean, full_batch=ctx.full_batch, parameter_broadcast=ctx.parameter_broadcast,
        strategy_save_file=ctx.strategy_ckpt_save_file, strategy_load_file=ctx.strategy_ckpt_load_file,
        dataset_strategy=ctx.dataset_strategy, zero_level=zero, context_parallel_algo=algo or ctx.context_parallel_algo,
        zero_shard_size=shard_size_of(ctx, state.world) if zero else None, context_parallel=context_parallel)
    state.runtime = runtime
    state.engines.append(runtime.grads)
    runtime.add_root(network)  # first: parameters and operators are named as in the user's network
    if loss_fn is not None:
        root = _WithLoss(network, loss_fn)
        bind(state, root)
        runtime.add_root(root)
        runtime.loss_root = root
    runtime.attach_optimizer(optimizer)


def _attach_data_parallel(state, network, ctx, layerwise: set[str]) -> None:
    """Replicas made equal once; replicated parameters summed by the bucketed reducer (through shared memory when
    every rank is on this CPU host), layerwise slices scaled only."""
    from autopar.parallel.data.replicas import equalize_replicas
    from autopar.parallel.grads.buckets import data_parallel_reducers
    from autopar.parallel.grads.layouts import LocalGrads

    equalize_replicas(network, ctx.parameter_broadcast, layerwise)
    params = [p for n, p in network.named_parameters() if n not in layerwise]
    local = [p for n, p in network.named_parameters() if n in layerwise]
    reducers = data_parallel_reducers(params, state.world, ctx)
    for reducer in reducers:
        reducer.watch(network)
    state.engines.extend(reducers)
    if local:
        state.engines.append(LocalGrads(local, state.world, ctx.gradients_mean))


def _plan(network, loss_fn, optimizer, sample, sample_kwargs=None):
    """AUTO_PARALLEL: the planner's choice for this network (rank 0 plans, every rank runs it), checked by the
    measured round (:mod:`autopar.parallel.trials`)."""
    from autopar.parallel.data.step_timer import DATA_PARALLEL_STEP
    from autopar.parallel.trials import measured_round
    from autopar.planner.api import finish, make_plan

    def move(t):
        return t.to(_device()) if isinstance(t, torch.Tensor) else t

    sample = [move(t) for t in sample]
    kwargs = {k: move(v) for k, v in (sample_kwargs or {}).items()}
    with _context.managed():  # the planner's trace calls the network: it must not parallelize itself meanwhile
        plan = make_plan(network, loss_fn, sample, kwargs, data_parallel_step=DATA_PARALLEL_STEP)
    plan = measured_round(network, loss_fn, optimizer, sample, plan, kwargs, prepare)
    finish(plan, network)
    return plan


# -- Model's view ---------------------------------------------------------------------------------------------------
def prepare(network: torch.nn.Module, loss_fn: Any = None, optimizer: torch.optim.Optimizer | None = None,
            sample: list | None = None, plan=None, sample_kwargs: dict | None = None) -> Prepared:
    """``attach`` plus how ``Model`` computes the loss of a batch (inputs..., label)."""
    state = attach(network, loss_fn, optimizer, sample, sample_kwargs=sample_kwargs, plan=plan)
    device = _device()
    if state.pipeline is not None:
        runner = state.pipeline
        step = runner.step if state.plan is None else (lambda *batch: runner.step(*runner.replica_batch(batch)))
        return Prepared(state, network, device, lambda inputs: step(*inputs), runs_backward=True,
                        sync_parameters=runner.gather_parameters)
    root = getattr(state.runtime, "loss_root", None) if state.runtime is not None else None
    if root is not None and loss_fn is not None and root.loss_fn is loss_fn and root.network is network:
        forward = root
    elif loss_fn is None:
        forward = network
    else:
        def forward(*inputs):
            return call_loss(loss_fn, network(*inputs[:-1]), inputs[-1])
    prepared = Prepared(state, network, device, lambda inputs: forward(*inputs))
    if _context.run_context().mode == _context.GRAPH_MODE and state.runtime is None:
        from autopar.perf.graph_mode import compile_forward, compiles

        if compiles(device):
            prepared.forward_loss = compile_forward(prepared.forward_loss)
            state.compiled = True
        elif not _comm.is_initialized() or _comm.get_rank() == 0:
            warnings.warn("autopar: GRAPH_MODE runs eagerly on the CPU: torch.compile measured slower there (the "
                          "tutorial's ResNet-50: a 169 s first compile, then ~5 % slower steps); AUTOPAR_COMPILE=1 "
                          "compiles anyway", stacklevel=user_stacklevel())
    return prepared


# -- the PyTorch door -----------------------------------------------------------------------------------------------
def parallelize(network: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                sample: list | None = None, *, zero: str | int | None = None,
                zero_shard_size: int | None = None) -> torch.nn.Module:
    """Make ``network`` train under the current parallel context when a loop calls it directly -- the PyTorch
    door's one call, like ``fully_shard(model)``. Optional: the first call of the network in a parallel mode does
    it by itself (:mod:`autopar.parallel.entry`). AUTO_PARALLEL plans on ``sample`` (the network's inputs).

    SEMI_AUTO/AUTO lay parameters out as slices on the first forward; DATA/HYBRID (and SEMI_AUTO without any
    strategy) keep them whole. Either way the gradients are complete when the backward returns, and optimizers --
    made before or after -- are moved onto the parameters that train before their next step.

    ``zero`` (1, 2, 3 or "level1".."level3") shards the optimizer state (and gradients, weights) of this network
    over the data-parallel ranks, ``zero_shard_size`` over groups of that many ranks (hybrid): the PyTorch
    spelling of ``enable_parallel_optimizer`` / ``optimizer_weight_shard_size``, for this network only.
    ``sample`` may be a dict: the keyword inputs (``{"input_ids": x, "labels": y}``)."""
    if not _comm.is_initialized():
        raise ConfigError("parallelize: call autopar.communication.init() first")
    ctx = _with_zero(_context.auto_parallel_context(), zero, zero_shard_size)
    if ctx.parallel_mode is ParallelMode.STAND_ALONE:
        return network
    if isinstance(sample, dict):
        attach(network, optimizer=optimizer, sample=[], ctx=ctx, sample_kwargs=sample)
    else:
        attach(network, optimizer=optimizer, sample=sample, ctx=ctx)
    return network


def _with_zero(ctx, zero, shard_size):
    """The context as seen by one ``parallelize(zero=..., zero_shard_size=...)`` call."""
    if zero is None and shard_size is None:
        return ctx
    level = f"level{zero}" if isinstance(zero, int) and not isinstance(zero, bool) else (zero or "level1")
    config = dict(ctx.parallel_optimizer_config or {}, optimizer_level=level)
    if shard_size is not None:
        config["optimizer_weight_shard_size"] = shard_size
    return dataclasses.replace(ctx, enable_parallel_optimizer=True, parallel_optimizer_config=config)


def takes_layouts(network: torch.nn.Module) -> bool:
    """Can :func:`apply_layouts` lay ``network`` out now: it runs on layouts already, or its mode lays networks
    out (SEMI_AUTO / AUTO) and no data-parallel runtime holds it yet?"""
    if runtime_of(network) is not None:
        return True
    mode = _context.auto_parallel_context().parallel_mode
    return mode in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL) and state_of(network) is None


def apply_layouts(network: torch.nn.Module, layouts: Any, resumed: bool = False) -> None:
    """Lay the network's parameters out as ``layouts`` says ({name: Layout or its dict}, or a strategy file)
    before anything runs -- what a checkpoint is loaded into. Replicated entries need nothing. ``resumed``: the
    layouts a resumed checkpoint was saved in; the run's own strategies, where they differ, re-lay them."""
    from autopar.layout.layout import Layout
    from autopar.layout.strategy_file import load_strategy_file

    if isinstance(layouts, (str, os.PathLike)):
        layouts = load_strategy_file(str(layouts))
    layouts = {k: v if isinstance(v, Layout) else Layout.from_dict(v) for k, v in dict(layouts).items()}
    sliced = {k: v for k, v in layouts.items() if not v.is_replicated()}
    if not sliced:
        return
    if runtime_of(network) is None:
        ctx = _context.auto_parallel_context()
        if ctx.parallel_mode not in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL):
            raise ConfigError(f"sliced layouts need parallel_mode=semi_auto_parallel or auto_parallel "
                              f"(now {ctx.parallel_mode.value})")
        if state_of(network) is not None:
            raise ConfigError("apply_layouts: the network already trains data-parallel; lay it out before its "
                              "first step")
        state = bind(ParallelState(ctx.parallel_mode, _comm.get_group_size()), network)
        _to_device(network, _device())
        _attach_layouts(state, network, None, None, ctx, _zero_level(ctx, ctx.parallel_mode))
    runtime = runtime_of(network)
    for name, layout in sliced.items():
        runtime.preset_layout(name, layout, resumed=resumed)


# -- small things ---------------------------------------------------------------------------------------------------
def _device() -> torch.device:
    return _comm.device() if _comm.is_initialized() else torch.device("cpu")


def _to_device(network: torch.nn.Module, device: torch.device) -> None:
    """Move what is not on ``device`` yet (a laid-out parameter is already there and cannot be swapped; a meta one
    is materialised there later)."""
    tensors = [*network.parameters(), *network.buffers()]
    if not any(t.is_meta for t in tensors):
        if any(t.device != device for t in tensors):
            network.to(device)
        return
    from autopar.common import replaced

    moved: dict[int, torch.Tensor] = {}  # one move per tensor: tied ones stay tied
    for module in network.modules():  # the rest stays where the mode materialises it
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None or t.is_meta or t.device == device:
                    continue
                if id(t) not in moved:
                    moved[id(t)] = replaced.successor(t, t.to(device))  # its class and attributes
                    if isinstance(t, torch.nn.Parameter):
                        replaced.record(t, moved[id(t)])
                table[name] = moved[id(t)]


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


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=user_stacklevel())
