"""Pipeline parallelism -- MindSpore's ``pipeline_stages`` + ``nn.PipelineCell`` and the PyTorch door's
:class:`PipelineParallel` -- on ``torch.distributed.pipelining``.

``S`` stages x ``D`` data-parallel replicas = the world; rank ``r`` runs stage ``r // D`` of replica ``r % D``
(MindSpore's numbering: the ranks of a stage are consecutive). The network is traced once and split before each
split point (:mod:`autopar.parallel.pipeline.split`: every piece computes with the network's own parameters, reads
the network inputs it needs -- targets on the last stage -- from the rank's own batch). A step splits the replica's
batch into ``micro_batches`` and runs a torch schedule (1F1B by default, GPipe, or interleaved ones with several
pieces per rank).

Exact as one process on the global batch, in any loop:

- the loss of a step is the mean of the micro-batches' losses (``reduction="mean"``, the PyTorch door) or their sum
  (``"sum"``: MindSpore's ``PipelineCell``, whose loss and gradients are ``micro_size`` x the mean); each
  micro-batch's loss is scaled before its backward, so gradients already in ``.grad`` (several ``step()`` calls
  before an optimizer step) are never scaled again;
- ``grads="full"`` (the PyTorch door): after a step every rank holds the *whole* network's gradient -- one
  all-reduce over all ranks of each rank's stage gradients (zeros elsewhere), which also sums a weight tied across
  stages and averages (``gradients_mean``) or sums the replicas. The user's own ``clip_grad_norm_`` then takes the
  global norm, the optimizer steps every parameter identically on every rank, and ``state_dict()`` is the whole,
  current network -- at the memory of data parallelism for gradients and optimizer state;
- ``grads="stage"`` (``Model`` with ``pipeline_stages``): a rank keeps only its stage's gradients (summed over the
  stage's replicas; a tied weight over the stages that hold it, as Megatron's embedding group) -- less memory; the
  other stages' parameters are made current by :meth:`gather_parameters` before anyone reads them whole.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar import context as _context
from autopar.comm.topology import pipeline_mesh
from autopar.common import grad_owners as owners
from autopar.errors import ConfigError, user_stacklevel
from autopar.labels import call_loss, class_indices
from autopar.layout.leaves import stacked_experts
from autopar.parallel.pipeline import stage_layout as layout
from autopar.parallel.pipeline.opaque_experts import opaque_while_traced, split_copies
from autopar.parallel.pipeline.split import network_output_loss, piece_calls, pieces_of
from autopar.parallel.pipeline.stage_strategies import recording

SCHEDULES = ("1f1b", "gpipe")


def _groups(num_stages: int, tensor: int = 1, context: int = 1) -> tuple[Any, Any, int, int]:
    """(pipeline group of this replica, data-parallel group of this stage, stage, replica)."""
    mesh = pipeline_mesh(num_stages, tensor, context)
    per_stage = dist.get_world_size() // num_stages
    rank = dist.get_rank()
    return mesh.get_group("pp"), mesh.get_group("dp"), rank // per_stage, rank % per_stage // (tensor * context)


stages_built: list[int] = []  # the stage counts of the pipelines made in this process (a dry run simulates each)


class PipelineParallel:
    """``network`` split before each of ``split_points`` (module names, in forward order) into
    ``len(split_points) + 1`` pieces over the world. ``step(*inputs)`` runs one training step's forward and backward
    over ``micro_batches`` micro-batches and returns the loss (on every rank); call the optimizer after it, as after
    ``loss.backward()``. With a ``loss_fn`` the last input is the label (``loss_fn(output, label)`` on the last
    stage); without one, all inputs are the network's and it returns its loss (or a tuple ending with it).

    With ``grads="stage"`` a stage's ranks may also share its work (:mod:`.stage_layout`): ``zero`` shards its
    optimizer over its replicas, ``tp`` / ``tensor_parallel`` split its modules over groups of ``tp`` ranks, ``cp`` /
    ``cp_algo`` its sequence over groups of ``cp`` ranks (every rank of such a group given the replica's batch),
    ``ep`` spread its mixture's experts over its replicas (expert parallelism: each token sent to its experts'
    replicas)."""

    def __init__(self, network: torch.nn.Module, loss_fn: Any, micro_batches: int, split_points: Sequence[str],
                 schedule: str = "1f1b", gradients_mean: bool = True, virtual_stages: int = 1,
                 reduction: str = "mean", grads: str = "full", zero: str | None = None, tp: int = 1,
                 tensor_parallel: dict | None = None, cp: int = 1, cp_algo: str = "all_gather", ep: int = 1,
                 from_strategies: bool = False):
        if not dist.is_initialized():
            raise ConfigError("pipeline parallel needs the cluster: call autopar.communication.init() first")
        if reduction not in ("mean", "sum") or grads not in ("full", "stage"):
            raise ConfigError(f"PipelineParallel: reduction must be 'mean' or 'sum' and grads 'full' or 'stage', "
                              f"got {reduction!r}, {grads!r}")
        self.network, self.loss_fn, self.reduction, self.grads = network, loss_fn, reduction, grads
        self.zero = layout.zero_level(zero, grads)
        self.tp, self.tensor_plan = layout.tensor_plan(tp, tensor_parallel, grads)
        self.cp, self.cp_algo = layout.context_plan(cp, cp_algo, grads, self.tensor_plan)
        self._sharded: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}  # id(network's) -> (it, shard)
        # interleaved: the network cut into S x V pieces, rank s holding pieces s, s + S, ... (a smaller bubble,
        # (S-1)/(V M + S - 1), for V times the point-to-point traffic)
        self.virtual_stages = int(virtual_stages)
        if self.virtual_stages < 1 or (len(split_points) + 1) % self.virtual_stages:
            raise ConfigError(f"{len(split_points) + 1} pipeline pieces do not split into virtual_stages="
                              f"{virtual_stages} per stage")
        self.num_stages = (len(split_points) + 1) // self.virtual_stages
        stages_built.append(self.num_stages)
        self.micro_batches = int(micro_batches)
        world = dist.get_world_size()
        if world % self.num_stages:
            raise ConfigError(f"pipeline_stages={self.num_stages} does not divide the {world} ranks")
        if self.micro_batches < 1:
            raise ConfigError(f"micro_size must be positive, got {micro_batches}")
        if self.micro_batches < self.num_stages:
            warnings.warn(f"micro_size={self.micro_batches} < pipeline_stages={self.num_stages}: the pipeline idles "
                          f"{(self.num_stages - 1) / (self.micro_batches + self.num_stages - 1):.0%} of each step "
                          "(bubble (S-1)/(M+S-1)); use micro_size >= 4 x stages", stacklevel=user_stacklevel())
        if schedule not in SCHEDULES:
            raise ConfigError(f"pipeline_scheduler={schedule!r}; expected one of {', '.join(SCHEDULES)}")
        names = dict(network.named_modules())
        unknown = [p for p in split_points if p not in names]
        if unknown:
            raise ConfigError(f"pipeline split point '{unknown[0]}' is not a module of the network")
        layout.check_plan_names(self.tensor_plan, names, dict(network.named_parameters(remove_duplicate=False)))
        marked = [n for n, m in names.items() if getattr(m, "_autopar_experts", False)]
        if marked and ep == 1:  # autopar.shard(model, {"*.experts": "expert"}), made for the layout modes
            warnings.warn(f"autopar: expert parallelism marked on '{marked[0]}' is the layout modes'; here each "
                          "stage's experts run whole on each of its ranks (inside pipeline stages it is "
                          "PipelineParallel(..., grads='stage', ep=N): the experts spread over a stage's replicas)",
                          stacklevel=user_stacklevel())
        experts = [n for n in self.tensor_plan if n in names and stacked_experts(names[n])]
        if experts:
            raise ConfigError(f"PipelineParallel tensor_parallel names '{experts[0]}', a module of stacked experts: "
                              "a tensor split does not split experts; spread them over the stage's replicas with "
                              "ep=N, and split the projections around them")
        self.split_points = list(split_points)
        self.schedule_name = schedule
        self.gradients_mean = gradients_mean
        inner = self.tp * self.cp
        if (world // self.num_stages) % inner:
            what = " x ".join(f"{k}={n}" for k, n in (("cp", self.cp), ("tp", self.tp)) if n > 1)
            raise ConfigError(f"PipelineParallel {what} does not divide the {world // self.num_stages} "
                              f"rank(s) of a pipeline stage ({world} ranks over {self.num_stages} stages)")
        self._ep_asked = ep
        self._lay_out_groups()
        # MindSpore's door: the operators' shard strategies say how the stages' weights split, which only the trace
        # shows (what each operator is given): the tensor group is then made as they say (stage_strategies)
        self.from_strategies = bool(from_strategies) and grads == "stage" and self.tp == 1 and self.cp == 1
        self._schedule = None
        self._edp_group = None  # experts spread over groups of ep replicas: the groups' copies of an expert
        self.stage_module: torch.nn.Module | None = None
        self._pieces: dict = {}
        self._released: dict = {}  # other stages' parameters given up by this rank (_release_other_stages)
        self.owner: dict[str, set[int]] = {}  # parameter / buffer name -> the stages that hold it
        from autopar.context import parallel_mode
        from autopar.parallel.state import ParallelState, bind, state_of

        # found from any part of the network (a checkpoint of the backbone); the network's first call must not
        # parallelize it on the side
        self.state = state_of(network) or bind(ParallelState(parallel_mode(), world), network)
        self.state.pipeline = self

    def _lay_out_groups(self) -> None:
        """The pipeline's, the stage's data-parallel and the experts' groups for ``tp`` and ``cp``."""
        world = dist.get_world_size()
        self.pp_group, self.dp_group, self.stage_index, self.replica = _groups(self.num_stages, self.tp, self.cp)
        self.replicas = world // self.num_stages // (self.tp * self.cp)
        self.ep = layout.expert_plan(self._ep_asked, self.grads, self.replicas)

    def _tensor_plan_from(self, uses) -> None:
        """The trace's record of the strategies (MindSpore's door) made the stage's tensor plan: its group laid out
        anew where it splits weights; where the strategies cannot run inside a stage, one warning says why."""
        from autopar.parallel.pipeline import stage_strategies

        tp, plan, why = stage_strategies.tensor_plan_of(uses, dist.get_world_size() // self.num_stages)
        sequence, why_not = stage_strategies.sequence_entries(self.network, tp)
        if why_not is not None:
            warnings.warn(f"autopar: sequence splits inside pipeline stages are not applied: {why_not}; those cells "
                          "run on the whole sequence", stacklevel=user_stacklevel())
        plan.update(sequence)
        if why is not None:
            warnings.warn(f"autopar: shard strategies inside pipeline stages are not applied: {why}; each stage runs "
                          "whole, replicated over its ranks", stacklevel=user_stacklevel())
        if tp > 1:
            self.tp, self.tensor_plan = tp, plan
            self._lay_out_groups()
            if self.zero is not None and self.replicas == 1:  # (said as the door says it without a tensor split)
                warnings.warn(f"autopar: enable_parallel_optimizer shards nothing here: the strategies split each "
                              f"stage's weights over all of its {tp} ranks, which leaves one replica a stage (ZeRO "
                              "shards a stage's optimizer over its data-parallel replicas)", stacklevel=user_stacklevel())

    # -- building (on the first batch: the trace needs real shapes) ------------------------------------------------
    def _build(self, inputs: tuple) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleLoopedBFS,
            SplitPoint,
            pipeline,
        )

        from autopar.comm import management as _comm

        batch = inputs[0].shape[0] if inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].dim() else 0
        if batch % self.micro_batches:
            raise ConfigError(f"the batch of {batch} does not split into micro_size={self.micro_batches} equal "
                              "micro-batches")
        example = tuple(t.tensor_split(self.micro_batches)[0] if isinstance(t, torch.Tensor) else t for t in inputs)
        if self.cp > 1:
            layout.check_sequence_divides(example, self.cp)
        deferred_build = _deferred_build(self.network)
        try:
            # the trace calls the network: it must not parallelize itself meanwhile
            with _context.managed(), _no_generation_cache(self.network), _stand_ins(self.network, deferred_build), \
                    layout.attention_traced_plainly(self.laid_out or self.from_strategies), \
                    opaque_while_traced(self.network), recording(self.network, self.from_strategies) as uses:
                pipe = pipeline(self.network, mb_args=example,
                                split_spec={name: SplitPoint.BEGINNING for name in self.split_points})
        except Exception as exc:  # noqa: BLE001 - torch.export's many failure types, said in one line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"pipeline: the network could not be split at {self.split_points} ({first}); what "
                              "crosses a stage boundary must be tensors") from None
        _warn_prints(self.network)
        if self.from_strategies:
            self._tensor_plan_from(uses)
        pieces = self.num_stages * self.virtual_stages
        if pipe.num_stages != pieces:
            raise ConfigError(f"pipeline: splitting at {self.split_points} gave {pipe.num_stages} stages, not "
                              f"{pieces} (is every split point called in the forward?)")
        if self.tp > 1:
            layout.check_sequence_beside_splits(pipe, self.tensor_plan)
        mine = list(range(self.stage_index, pieces, self.num_stages))  # this rank's pieces (one unless interleaved)
        self._pieces, users = pieces_of(pipe, self.network, set(mine))
        self.owner = {name: {k % self.num_stages for k in ks} for name, ks in users.items()}
        if deferred_build:  # grads="stage": this stage's parameters and buffers made real, only they; "full" steps
            # every parameter on every rank, so there the network is made whole
            _materialize_stage(self.network, {name for name, ks in users.items() if ks & set(mine)}
                               if self.grads == "stage" else None, [self._pieces[k] for k in mine])
        modules = [self._pieces[k] for k in mine]
        # (the whole split network run once for its shapes: before the stage's pieces hold ZeRO's shards)
        shapes = _static_shapes(pipe, example) if _fake_group(self.pp_group) else {}
        if self.grads == "stage" and not deferred_build:  # a network built whole on every rank: the other stages'
            # weights give their memory up (as a stage's own build never makes them; gather_parameters brings them)
            self._released = _release_other_stages(self.network, users, set(mine))
        mesh = pipeline_mesh(self.num_stages, self.tp, self.cp)
        # (found before a tensor split gives their weights up: a module half given up no longer looks stacked)
        experts = {name for name, m in self.network.named_modules() if stacked_experts(m)} if self.ep > 1 else set()
        if self.laid_out:
            inner = tuple(name for name, n in (("cp", self.cp), ("tp", self.tp)) if n > 1)
            layout.split_over_tensor_group(modules, self.network, self._sharded, mesh[inner], self.tensor_plan,
                                           self.cp_algo if self.cp > 1 else None)
        if self.ep > 1:  # the experts spread over the stage's replicas, or over groups of ep of them
            experts_mesh = mesh["dp"] if self.ep == self.replicas else mesh._unflatten(
                "dp", (self.replicas // self.ep, self.ep), ("edp", "ep"))["edp", "ep"]
            if experts_mesh.ndim == 2:  # the groups' copies of an expert, summed over after each step
                self._edp_group = experts_mesh.get_group("edp")
            layout.spread_experts(modules, self.network, self._sharded, experts_mesh, experts,
                                  zero=self.zero is not None)
        if self.zero is not None:  # (after the tensor split: FSDP2 shards the split weights over the replicas)
            layout.shard_over_replicas(modules, self.network, self._sharded, mesh["dp"], self.zero,
                                       self.gradients_mean)
        self.stage_module = modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules)
        stages = [PipelineStage(self._pieces[k], k, pieces, _comm.device(), group=self.pp_group, **shapes.get(k, {}))
                  for k in mine]
        for stage in stages:
            piece = stage.submod
            if piece.reads_inputs() and not hasattr(stage, "register_forward_context"):
                raise ConfigError(f"pipeline: piece {piece.index} reads the network's inputs (targets?), which "
                                  f"needs torch >= 2.15 (this is {torch.__version__}); give a loss_fn and the "
                                  "targets as the label instead")
            if piece.index > 0 and hasattr(stage, "register_forward_context"):
                stage.register_forward_context(piece.running)  # which micro-batch; and the shape probe, told apart
        loss_fn, scale = self.loss_fn, 1.0 / self.micro_batches if self.reduction == "mean" else 1.0

        def micro_batch_loss(output, label):
            loss = network_output_loss(output) if loss_fn is None else call_loss(loss_fn, output, label)
            return loss * scale if scale != 1.0 else loss

        if self.virtual_stages == 1:
            kind = Schedule1F1B if self.schedule_name == "1f1b" else ScheduleGPipe
            self._schedule = kind(stages[0], self.micro_batches, loss_fn=micro_batch_loss, scale_grads=False)
        else:  # several pieces per rank: interleaved 1F1B, or looped breadth-first (GPipe's order per piece)
            kind = ScheduleInterleaved1F1B if self.schedule_name == "1f1b" else ScheduleLoopedBFS
            self._schedule = kind(stages, self.micro_batches, loss_fn=micro_batch_loss, scale_grads=False)

    @property
    def gradient_sync(self) -> str:
        """How a step's gradients are completed, for the run's one-line summary."""
        split = f"; its modules split over tensor groups of {self.tp}" if self.tp > 1 else ""
        if self.cp > 1:
            split += f"; its sequence split over context groups of {self.cp} ({self.cp_algo} attention)"
        return self._gradient_sync() + split

    @property
    def laid_out(self) -> bool:
        """Does a stage's piece run on DTensors over its inner group (tensor or context parallelism)?"""
        return self.tp > 1 or self.cp > 1

    def _gradient_sync(self) -> str:
        if self.grads == "full":
            return "every stage's summed over all ranks after the last micro-batch (all-reduce)"
        if self.replicas == 1:
            return "each stage's its own (one replica a stage: nothing to sum)"
        how = "reduce-scattered into ZeRO's shards (FSDP2)" if self.zero else "all-reduced"
        spread = "" if self.ep == 1 else (
            f"; its experts spread over its {self.replicas} replicas (each rank's experts' gradients its own)"
            if self.ep == self.replicas else f"; its experts spread over groups of {self.ep} of its {self.replicas} "
            f"replicas (an expert's gradients summed over the {self.replicas // self.ep} groups' copies" + (
                ", reduce-scattered into ZeRO's shards of them)" if self.zero else ")"))
        return f"each stage's {how} over its {self.replicas} replicas after the last micro-batch" + spread

    def _training(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        """The parameter that trains for the network's ``param``: its ZeRO shard, or itself."""
        return self._sharded.get(id(param), (param, param))[1]

    def parameters(self):
        """This rank's stage's parameters (all of the network's before the first step)."""
        return (self.stage_module or self.network).parameters()

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == self.num_stages - 1

    # -- a step -------------------------------------------------------------------------------------------------
    def step(self, *inputs: torch.Tensor) -> torch.Tensor:
        """This replica's batch (the same on all its stages): the network's inputs, then the label when there is a
        ``loss_fn``. Returns the step's loss on every rank, as one process on the global batch reports it."""
        if self.loss_fn is not None:
            if len(inputs) < 2:
                raise ConfigError("pipeline step: give the network's inputs and the label")
            inputs, target = inputs[:-1], class_indices(inputs[-1])
        else:
            if not inputs:
                raise ConfigError("pipeline step: give the network's inputs")
            target = torch.zeros(inputs[0].shape[0])  # the loss is the network's own: the schedule's label is unused
        if self._schedule is None:
            self._build(inputs)
            if self.from_strategies:  # the run's line, now that the strategies' tensor group is known
                from autopar.parallel.summary import announce

                announce(self.state, self.network)
        for piece in self._pieces.values():  # later pieces read the network inputs they need from here
            if piece.reads_inputs():
                piece.feed = list(zip(*[t.tensor_split(self.micro_batches) if isinstance(t, torch.Tensor)
                                        else [t] * self.micro_batches for t in inputs]))
        carried = self._set_aside_gradients()
        losses: list[torch.Tensor] = []
        # (the stages' modules are called by the schedule, not as networks to parallelize; under tensor parallelism
        # a piece's plain tensors meet its split weights as replicated, in the backward too)
        with _context.managed(), layout.implicit_replication_while(self.laid_out):
            if self.stage_index == 0:
                self._schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
            else:
                self._schedule.step(target=target, losses=losses, return_outputs=False)
        # float32 on every rank alike (a float64 default dtype must not make the broadcast's two ends differ)
        loss = torch.stack([x.detach().float() for x in losses]).sum() if losses else torch.zeros((),
                                                                                             dtype=torch.float32)
        if self.num_stages > 1:  # every rank of the replica reports its loss ...
            last = dist.get_global_rank(self.pp_group, self.num_stages - 1)
            dist.broadcast(loss, src=last, group=self.pp_group)
        if self.replicas > 1:  # ... and the loss of the global batch, as one process would
            dist.all_reduce(loss, group=self.dp_group)
            loss /= self.replicas
        self._complete_gradients(carried)
        return owners.mark_backward_done(loss)  # value_and_grad takes the gradients from .grad

    # -- gradients -------------------------------------------------------------------------------------------------
    def _network_parameters(self) -> list[torch.nn.Parameter]:
        """The trainable parameters some piece computes with (one no piece uses keeps no gradient, as in one
        process)."""
        named = self.network.named_parameters(remove_duplicate=False)
        used = {id(p) for n, p in named if n in self.owner}
        return [self._training(p) for p in self.network.parameters()
                if p.requires_grad and (id(p) in used or not self.owner)]

    def _set_aside_gradients(self) -> dict[int, torch.Tensor]:
        """Gradients of earlier steps (accumulation): kept out of this step's sums, added back after them."""
        carried = {}
        for p in self._network_parameters():
            if p.grad is not None:
                carried[id(p)] = p.grad
                p.grad = None
        return carried

    def _complete_gradients(self, carried: dict[int, torch.Tensor]) -> None:
        from autopar.parallel.grads.transports import reduce_now

        params = self._network_parameters()
        replicas = 1.0 / self.replicas if self.gradients_mean else 1.0
        if self.grads == "full":  # every rank: the whole gradient (stages summed, replicas averaged or summed)
            if dist.get_world_size() > 1:
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                grads = reduce_now(grads, None, replicas)
                for p, g in zip(params, grads):
                    p.grad = g
        else:  # this stage's gradients over its replicas; a weight tied across stages over the stages holding it
            mine = [p for p in self.stage_module.parameters() if p.grad is not None]
            spread = [p for p in mine if getattr(p, "_autopar_spread", False)]  # (whole over the group's tokens)
            mine = [p for p in mine if not getattr(p, "_autopar_spread", False)]
            if self.replicas > 1 and self.zero is None:  # (ZeRO's shards: FSDP2 reduce-scattered them)
                reduce_now([layout.local(p.grad) for p in mine], self.dp_group, replicas, into=True)
            if spread:  # the replicas' mean, as the others' (their losses' gradients were summed there); spread over
                # groups of ep replicas, each group's copies summed first
                # (ZeRO's shards of the groups' copies arrive summed over them: the experts' operator
                # reduce-scattered them)
                copies = [p for p in spread if self._edp_group is not None and not split_copies(p)]
                if copies:
                    reduce_now([layout.local(p.grad) for p in copies], self._edp_group, replicas, into=True)
                summed = {id(p) for p in copies}
                for p in spread:
                    if id(p) not in summed:
                        layout.local(p.grad).mul_(replicas)
            tied = [self._training(p) for p in self._tied_parameters()]
            if tied:  # (sharded alike on every stage that holds one: the local slices line up)
                grads = [layout.local(p.grad) if p.grad is not None else torch.zeros_like(layout.local(p))
                         for p in tied]
                reduce_now(grads, self.pp_group, 1.0, into=True)
                for p, g in zip(tied, grads):
                    if p.grad is None:  # a stage holding the weight that gave it no gradient: the others' sum
                        p.grad = layout.like(p, g)
        for p in params:
            kept = carried.get(id(p))
            if kept is not None:
                p.grad = kept if p.grad is None else p.grad.add_(kept)

    def _tied_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters more than one stage holds (every rank of the pipeline group lists them alike)."""
        named = dict(self.network.named_parameters(remove_duplicate=False))
        out, seen = [], set()
        for name in sorted(self.owner):
            p = named.get(name)
            if p is not None and len(self._stages_of(p)) > 1 and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def _stages_of(self, param: torch.nn.Parameter) -> set[int]:
        names = [n for n, p in self.network.named_parameters(remove_duplicate=False) if p is param]
        return set().union(*(self.owner.get(n, set()) for n in names)) if names else set()

    # -- the whole network on every rank ----------------------------------------------------------------------
    def replica_batch(self, inputs) -> tuple:
        """The batches the ranks of this replica's stages hold, concatenated in rank order: what the replica
        trains on when every rank was given its own data-parallel share (AUTO_PARALLEL's planned pipeline)."""
        if self.num_stages == 1:
            return tuple(inputs)
        out = []
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.dim():
                parts = [torch.empty_like(t) for _ in range(self.num_stages)]
                dist.all_gather(parts, t.contiguous(), group=self.pp_group)
                t = torch.cat(parts)
            out.append(t)
        return tuple(out)

    @contextlib.contextmanager
    def full_parameters(self):
        """Every rank holds every stage's current parameters and buffers (broadcast from their stage): what an
        integrated or sliced save needs so that any layout can read it."""
        self.gather_parameters()
        yield

    def gather_parameters(self) -> None:
        """Broadcast every stage's parameters and buffers from its ranks to all: after it the whole network is
        current on every rank (``Model`` does it when training ends and before it evaluates or predicts). With
        ``grads="full"`` every rank stepped every parameter already: only the buffers travel."""
        if self.stage_module is None or self.num_stages == 1:
            return
        from autopar.common import deferred

        deferred.allocate(self.network, device=_device())  # (a stage's own build: the others' get storage here)
        for p, shape in self._released.values():  # (the other stages' weights given up after an eager build too)
            if p.numel() == 0 and math.prod(shape):
                p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
        own = dict(self.network.named_parameters(remove_duplicate=False))
        with torch.no_grad():  # ZeRO's shards first made whole in the network's own parameters (in name order:
            for name in sorted(self.owner):  # every rank of the stage gathers alike)
                pair = self._sharded.get(id(own.get(name)))
                if pair is not None and pair[0].numel() != pair[1].numel():
                    pair[0].data = pair[1].full_tensor().detach().clone()
        state = dict(self.network.named_buffers())
        if self.grads == "stage":
            state.update(self.network.named_parameters())
        with torch.no_grad():
            for name in sorted(state):
                stages = self.owner.get(name)
                if stages:
                    dist.broadcast(state[name].data, src=dist.get_global_rank(self.pp_group, min(stages)),
                                   group=self.pp_group)


@contextlib.contextmanager
def _no_generation_cache(network: torch.nn.Module):
    """A Hugging Face model returns its key/value cache for generation (``config.use_cache``, on by default): an
    object no stage can send, and nothing a training step uses. Off while the network is traced (the traced
    stages are what runs), back as it was after."""
    config = getattr(network, "config", None)
    if getattr(config, "use_cache", None) is not True:
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


def _device() -> torch.device:
    from autopar.comm import management as _comm

    return _comm.device()


def _deferred_build(network: torch.nn.Module) -> bool:
    """Is ``network`` built on the meta device (``deferred_init``, ``no_init_parameters``, ``torch.device("meta")``)?
    Then its initialisers are recorded (a plain meta build's), the ranks' draws checked alike, and the first call's
    whole materialisation called off: each stage makes only its own tensors (:func:`_materialize_stage`)."""
    from autopar.common import deferred
    from autopar.parallel.seeds import same_draws_everywhere

    if not deferred.has_meta(network):
        return False
    deferred.record_initialisers(network)
    same_draws_everywhere(network, _context.auto_parallel_context().parameter_broadcast)
    deferred.take(network)
    return True


@contextlib.contextmanager
def _stand_ins(network: torch.nn.Module, active: bool):
    """While the trace runs, each meta tensor of ``network`` replaced by a stand-in on the host that costs one
    element (a zero expanded to its shape): the trace reads shapes, never values, and a meta tensor would bake the
    meta device into what the network makes in its forward (``torch.arange(t, device=idx.device)``)."""
    if not active:
        yield
        return
    from autopar.common import deferred

    with deferred.swapped([network], deferred.is_meta, lambda t: torch.zeros((), dtype=t.dtype).expand(t.shape)):
        yield


def _materialize_stage(network: torch.nn.Module, names: set[str] | None, pieces: list) -> None:
    """The network's tensors this rank's pieces use (``names``; None: all), made real and whole on its device, the
    pieces holding them; the other stages' stay on the meta device, never computed."""
    from autopar.common import deferred

    from .split import _use_network_parameters

    if names is None:
        deferred.make_whole(network, device=_device())
    else:
        deferred.materialize_named(network, names, device=_device())
    for piece in pieces:
        _use_network_parameters(piece.graph_module, network)


def _release_other_stages(network: torch.nn.Module, users: dict, mine: set[int]) -> dict:
    """The parameters only other stages' pieces use give their memory up (an empty tensor in place, as a stage's
    own do to their splits and shards -- the same objects: an optimizer made before still holds them, and steps
    only what has gradients): a rank holds its stage's weights, not the whole network's -- (S-1)/S of them fewer
    with S stages. Returns id -> (parameter, its shape), from which ``gather_parameters`` gives them storage again
    and fills it from their stages."""
    keep, other = set(), {}
    for name, p in network.named_parameters(remove_duplicate=False):
        if users.get(name, set()) & mine or not users.get(name) or p.is_meta or isinstance(p, DTensor):
            keep.add(id(p))  # this stage's (under any of its names), used by no piece, not a plain tensor
        else:
            other[id(p)] = p
    released = {}
    for key, p in other.items():
        if key not in keep:
            released[key] = (p, tuple(p.shape))
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return released


def pipeline_of(network: torch.nn.Module) -> PipelineParallel | None:
    from autopar.parallel.state import state_within

    state = state_within(network)
    return state.pipeline if state is not None else None


def _warn_prints(network: torch.nn.Module) -> None:
    """``ops.Print`` inside a network split into stages: the traced stages hold tensor operations only, so it prints
    nothing there -- said once instead of silently."""
    from autopar.errors import warn_once
    from autopar.ops.array import Print

    names = [name for name, m in network.named_modules() if isinstance(m, Print)]
    if names:
        warn_once("pipeline-print", f"ops.Print in a pipelined network prints nothing ({', '.join(names[:3])}): "
                                    "the stages are traced and keep tensor operations only; print outside the network")


def _fake_group(group) -> bool:
    """A dry run's fake process group (``autopar launch --dry-run``): no peer answers torch's shape probe."""
    try:
        return dist.get_backend(group) == "fake"
    except Exception:  # noqa: BLE001 - a backend torch cannot name is a real one
        return False


def _static_shapes(pipe, example: tuple) -> dict[int, dict]:
    """What every piece receives and returns, from one pass of the split network on the example micro-batch --
    the static metadata a stage needs where no peer can answer the shape probe (a dry run's fake world)."""
    calls = [n.target for n in piece_calls(pipe)]
    outs: dict[int, Any] = {}
    hooks = [pipe.split_gm.get_submodule(name).register_forward_hook(lambda m, a, o, k=k: outs.__setitem__(k, o))
             for k, name in enumerate(calls)]
    try:
        with torch.no_grad(), _context.managed():  # shapes only: no graph held (the dry run counts memory)
            pipe(*example)
    finally:
        for h in hooks:
            h.remove()

    trains = any(p.requires_grad for p in pipe.split_gm.parameters())

    def as_args(value, grads: bool):  # what flows between pieces carries a gradient where it is floating point
        values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        return tuple(v.detach().contiguous().requires_grad_(grads and v.is_floating_point())  # as Piece sends it
                     if isinstance(v, torch.Tensor) else v for v in values)

    return {k: {"input_args": as_args(example, False) if k == 0 else as_args(outs[k - 1], trains),
                "output_args": as_args(outs[k], trains)} for k in range(len(calls))}
