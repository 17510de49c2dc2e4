"""Pipeline parallelism -- MindSpore's ``pipeline_stages`` + ``nn.PipelineCell`` -- on ``torch.distributed.pipelining``.

``S`` stages x ``D`` data-parallel replicas = the world; rank ``r`` runs stage ``r // D`` of replica ``r % D``
(MindSpore's numbering: the ranks of a stage are consecutive). The network-with-loss is traced once
(``torch.distributed.pipelining.pipeline``, torch.export underneath) and split *before* the first cell of each
stage -- the stage of a cell is its own ``pipeline_stage`` or its nearest ancestor's -- so any forward code between
the cells goes where it runs. Each rank keeps its stage's submodule, whose parameters are the network's own
objects (an optimizer made on ``net.parameters()`` steps them; the other stages' parameters get no gradient here
and are skipped by every torch optimizer).

A step splits the replica's batch into ``micro_size`` micro-batches and runs a torch schedule (1F1B by default,
GPipe with ``pipeline_config={"pipeline_scheduler": "gpipe"}``). Loss semantics are one process's on the global
batch: the step's loss is the mean of the micro-batch losses (each a mean over its micro-batch) and of the replicas'
(every rank reports the global batch's loss), gradients are
divided by ``micro_size`` (torch's ``scale_grads``), then averaged (``gradients_mean``) or summed over the replicas
of the stage.

The PyTorch door: :class:`PipelineParallel` with explicit split points (module names), the same engine.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Sequence

import torch
import torch.distributed as dist

from autopar import context as _context
from autopar.errors import ConfigError
from autopar.labels import call_loss, class_indices

SCHEDULES = ("1f1b", "gpipe")


def stage_of_modules(network: torch.nn.Module, attr: str = "pipeline_stage", unset: int = -1) -> dict[str, int]:
    """``{module name: pipeline stage}`` (or another cell attribute, e.g. ``pipeline_segment``) for every module,
    inherited from the nearest annotated ancestor (``unset``: none)."""
    stages: dict[str, int] = {}
    for name, module in network.named_modules():
        own = getattr(module, attr, None)
        parent = name.rpartition(".")[0] if name else None
        inherited = stages.get(parent, unset) if parent is not None else unset
        stages[name] = int(own) if own is not None else inherited
    return stages


def segments_of(network: torch.nn.Module) -> int:
    """How many virtual segments the cells' ``pipeline_segment`` marks (MindSpore's interleaved pipeline): 1 + the
    largest, 1 when no cell has one."""
    return 1 + max([int(getattr(m, "pipeline_segment", 0) or 0) for m in network.modules()] + [0])


def split_points_from_stages(network: torch.nn.Module, num_stages: int, segments: int = 1) -> list[str]:
    """The module each piece after the first begins with, from the cells' ``pipeline_stage`` (and, interleaved,
    ``pipeline_segment``: piece = segment x S + stage, in forward order); one-line errors for a cell with parameters
    but no stage, a stage out of range or unused, and stages that do not follow the forward order."""
    stages = stage_of_modules(network)
    unstaged = [n or type(network).__name__ for n, m in network.named_modules()
                if stages[n] < 0 and any(True for _ in m.parameters(recurse=False))]
    if unstaged:
        raise ConfigError(f"pipeline_stages={num_stages}: cell '{unstaged[0]}' has parameters but no pipeline_stage "
                          f"(set cell.pipeline_stage = k on it or a parent){' and more' if len(unstaged) > 1 else ''}")
    if segments > 1:
        return _split_points_interleaved(network, stages, num_stages, segments)
    out_of_range = sorted({s for s in stages.values() if s >= num_stages})
    if out_of_range:
        raise ConfigError(f"pipeline_stage {out_of_range[0]} is out of range: pipeline_stages={num_stages} numbers "
                          f"stages 0..{num_stages - 1}")
    first: dict[int, str] = {}
    last_stage = -1
    for name, _ in network.named_modules():
        s = stages[name]
        if s < 0 or not name:
            continue
        if s < last_stage and stages.get(name.rpartition(".")[0], -1) != s:
            raise ConfigError(f"cell '{name}' is in pipeline_stage {s} after a cell of stage {last_stage}: stages "
                              "must follow the order the forward runs the cells in")
        last_stage = max(last_stage, s)
        first.setdefault(s, name)
    missing = [s for s in range(num_stages) if s not in first and s > 0]
    if missing:
        raise ConfigError(f"pipeline_stages={num_stages} but no cell has pipeline_stage {missing[0]}")
    return [first[s] for s in range(1, num_stages)]


def _split_points_interleaved(network: torch.nn.Module, stages: dict[str, int], num_stages: int,
                              segments: int) -> list[str]:
    seg = stage_of_modules(network, "pipeline_segment", unset=0)
    first: dict[int, str] = {}
    last = -1
    for name, _ in network.named_modules():
        if not name or stages[name] < 0:
            continue
        if stages[name] >= num_stages:
            raise ConfigError(f"pipeline_stage {stages[name]} is out of range: pipeline_stages={num_stages} numbers "
                              f"stages 0..{num_stages - 1}")
        piece = seg[name] * num_stages + stages[name]
        parent = name.rpartition(".")[0]
        if piece < last and (seg.get(parent, 0) * num_stages + stages.get(parent, -1)) != piece:
            raise ConfigError(f"cell '{name}' (segment {seg[name]}, stage {stages[name]}) runs after a cell of a later "
                              "piece: segments, then stages, must follow the order the forward runs the cells in")
        last = max(last, piece)
        first.setdefault(piece, name)
    missing = [k for k in range(1, num_stages * segments) if k not in first]
    if missing:
        raise ConfigError(f"pipeline_interleave: no cell has pipeline_segment {missing[0] // num_stages} and "
                          f"pipeline_stage {missing[0] % num_stages}")
    return [first[k] for k in range(1, num_stages * segments)]


def _groups(num_stages: int) -> tuple[Any, Any, int, int]:
    """(pipeline group of this replica, data-parallel group of this stage, stage, replica)."""
    from autopar.comm.topology import pipeline_mesh

    mesh = pipeline_mesh(num_stages)
    replicas = dist.get_world_size() // num_stages
    rank = dist.get_rank()
    return mesh.get_group("pp"), mesh.get_group("dp"), rank // replicas, rank % replicas


class PipelineParallel:
    """``network`` split before each of ``split_points`` (module names, in forward order) into
    ``len(split_points) + 1`` stages over the world, ``loss_fn(output, label)`` on the last stage;
    ``step(*inputs, label)`` runs one training step's forward and backward over ``micro_batches`` micro-batches and
    returns the loss (on every rank). Call the optimizer's ``step()`` after it, as after ``loss.backward()``."""

    def __init__(self, network: torch.nn.Module, loss_fn: Any, micro_batches: int, split_points: Sequence[str],
                 schedule: str = "1f1b", gradients_mean: bool = True, virtual_stages: int = 1):
        if not dist.is_initialized():
            raise ConfigError("pipeline parallel needs the cluster: call autopar.communication.init() first")
        self.network = network
        self.loss_fn = loss_fn
        # interleaved: the network cut into S x V pieces, rank s holding pieces s, s + S, ... (a smaller bubble,
        # (S-1)/(V M + S - 1), for V times the point-to-point traffic)
        self.virtual_stages = int(virtual_stages)
        if self.virtual_stages < 1 or (len(split_points) + 1) % self.virtual_stages:
            raise ConfigError(f"{len(split_points) + 1} pipeline pieces do not split into virtual_stages="
                              f"{virtual_stages} per stage")
        self.num_stages = (len(split_points) + 1) // self.virtual_stages
        self.micro_batches = int(micro_batches)
        world = dist.get_world_size()
        if world % self.num_stages:
            raise ConfigError(f"pipeline_stages={self.num_stages} does not divide the {world} ranks")
        if self.micro_batches < 1:
            raise ConfigError(f"micro_size must be positive, got {micro_batches}")
        if self.micro_batches < self.num_stages:
            warnings.warn(f"micro_size={self.micro_batches} < pipeline_stages={self.num_stages}: the pipeline idles "
                          f"{(self.num_stages - 1) / (self.micro_batches + self.num_stages - 1):.0%} of each step "
                          "(bubble (S-1)/(M+S-1)); use micro_size >= 4 x stages", stacklevel=3)
        if schedule not in SCHEDULES:
            raise ConfigError(f"pipeline_scheduler={schedule!r}; expected one of {', '.join(SCHEDULES)}")
        names = dict(network.named_modules())
        unknown = [p for p in split_points if p not in names]
        if unknown:
            raise ConfigError(f"pipeline split point '{unknown[0]}' is not a module of the network")
        self.split_points = list(split_points)
        self.schedule_name = schedule
        self.gradients_mean = gradients_mean
        self.pp_group, self.dp_group, self.stage_index, self.replica = _groups(self.num_stages)
        self.replicas = world // self.num_stages
        self._schedule = None
        self.stage_module: torch.nn.Module | None = None
        self.owner: dict[str, int] = {}
        from autopar.context import parallel_mode
        from autopar.parallel.state import ParallelState, bind, state_of

        # found from any part of the network (a checkpoint of the backbone); the network's first call must not
        # parallelize it on the side
        self.state = state_of(network) or bind(ParallelState(parallel_mode(), world), network)
        self.state.pipeline = self

    # -- building (on the first batch: the trace needs real shapes) ------------------------------------------------
    def _build(self, inputs: tuple) -> None:
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleLoopedBFS,
            SplitPoint,
            pipeline,
        )

        from autopar.comm import management as _comm

        batch = inputs[0].shape[0] if inputs else 0
        if batch % self.micro_batches:
            raise ConfigError(f"the batch of {batch} does not split into micro_size={self.micro_batches} equal "
                              "micro-batches")
        example = tuple(t.tensor_split(self.micro_batches)[0] if isinstance(t, torch.Tensor) else t for t in inputs)
        try:
            with _context.managed():  # the trace calls the network: it must not parallelize itself meanwhile
                pipe = pipeline(self.network, mb_args=example,
                                split_spec={name: SplitPoint.BEGINNING for name in self.split_points})
        except Exception as exc:  # noqa: BLE001 - torch.export's many failure types, said in one line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"pipeline: the network could not be split at {self.split_points} ({first}); what "
                              "crosses a stage boundary must be tensors") from None
        pieces = self.num_stages * self.virtual_stages
        if pipe.num_stages != pieces:
            raise ConfigError(f"pipeline: splitting at {self.split_points} gave {pipe.num_stages} stages, not "
                              f"{pieces} (is every split point called in the forward?)")
        mine = range(self.stage_index, pieces, self.num_stages)  # this rank's pieces (one unless interleaved)
        modules = [pipe.get_stage_module(k) for k in mine]
        self.stage_module = modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules)
        # which stage owns each parameter and buffer (the split graph names them submod_<piece>.<network name>)
        self.owner = {}
        for name, _ in [*pipe.split_gm.named_parameters(), *pipe.split_gm.named_buffers()]:
            head, _, rest = name.partition(".")
            self.owner[rest] = int(head.rpartition("_")[2]) % self.num_stages
        stages = [pipe.build_stage(k, _comm.device(), group=self.pp_group) for k in mine]
        loss_fn = self.loss_fn

        def last_stage_loss(output, label):
            return call_loss(loss_fn, output, label)

        if self.virtual_stages == 1:
            kind = Schedule1F1B if self.schedule_name == "1f1b" else ScheduleGPipe
            self._schedule = kind(stages[0], self.micro_batches, loss_fn=last_stage_loss, scale_grads=True)
        else:  # several pieces per rank: interleaved 1F1B, or looped breadth-first (GPipe's order per piece)
            kind = ScheduleInterleaved1F1B if self.schedule_name == "1f1b" else ScheduleLoopedBFS
            self._schedule = kind(stages, self.micro_batches, loss_fn=last_stage_loss, scale_grads=True)

    def parameters(self):
        """This rank's stage's parameters (all of the network's before the first step)."""
        return (self.stage_module or self.network).parameters()

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def step(self, *inputs: torch.Tensor) -> torch.Tensor:
        """``inputs``: the network's inputs, then the label (this replica's batch, the same on all its stages)."""
        if len(inputs) < 2:
            raise ConfigError("pipeline step: give the network's inputs and the label")
        inputs, target = inputs[:-1], class_indices(inputs[-1])
        if self._schedule is None:
            self._build(inputs)
        losses: list[torch.Tensor] = []
        with _context.managed():  # the stages' modules are called by the schedule, not as networks to parallelize
            if self.stage_index == 0:
                self._schedule.step(*inputs, target=target, losses=losses)
            else:
                self._schedule.step(target=target, losses=losses)
        loss = torch.stack([x.detach().float() for x in losses]).mean() if losses else torch.zeros(())
        if self.num_stages > 1:  # every rank of the replica reports its loss ...
            last = dist.get_global_rank(self.pp_group, self.num_stages - 1)
            dist.broadcast(loss, src=last, group=self.pp_group)
        if self.replicas > 1:  # ... and the loss of the global batch, as one process would
            dist.all_reduce(loss, group=self.dp_group)
            loss /= self.replicas
        self._reduce_gradients()
        return loss

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

    def _reduce_gradients(self) -> None:
        """The replicas of this stage sum (or average) their gradients: one collective per bucket."""
        if self.replicas == 1:
            return
        from autopar.parallel.grads.transports import reduce_now

        grads = [p.grad for p in self.stage_module.parameters() if p.grad is not None]
        reduce_now(grads, self.dp_group, 1.0 / self.replicas if self.gradients_mean else 1.0, into=True)

    @contextlib.contextmanager
    def full_parameters(self):
        """Every rank holds every stage's current parameters and buffers (broadcast from their stage): what an
        integrated or sliced save needs so that any layout can read it."""
        self.gather_parameters()
        yield

    def gather_parameters(self) -> None:
        """Broadcast every stage's parameters and buffers from its ranks to all: after it the whole network is
        current on every rank (``Model`` does it when training ends and before it evaluates or predicts)."""
        if self.stage_module is not None and self.num_stages > 1:
            state = {**dict(self.network.named_parameters()), **dict(self.network.named_buffers())}
            with torch.no_grad():
                for name, stage in self.owner.items():
                    if name in state:
                        dist.broadcast(state[name].data, src=dist.get_global_rank(self.pp_group, stage),
                                       group=self.pp_group)


def pipeline_of(network: torch.nn.Module) -> PipelineParallel | None:
    from autopar.parallel.state import state_within

    state = state_within(network)
    return state.pipeline if state is not None else None
