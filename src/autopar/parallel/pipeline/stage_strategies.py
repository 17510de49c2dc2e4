"""MindSpore's shard strategies inside pipeline stages: what the operators' strategies say of the weights they are
given, read while the network is traced, as the stage's tensor-parallel plan.

In MindSpore a strategy under ``pipeline_stages`` is written for the ranks of one stage: ``ops.MatMul().shard(((dp,
1), (1, mp)))`` splits the weight's output columns over ``mp`` of them (Megatron's column split), ``((dp, mp), (mp,
1))`` its rows (the row split), and the batch over ``dp``. autopar runs the stage's weights split as the strategies
split them over a tensor group of ``mp`` ranks (:func:`~autopar.parallel.pipeline.stage_layout.split_over_tensor_group`,
each piece on DTensor's sharding propagation), the stage's other ranks its data-parallel replicas; a strategy that
splits no weight (only the batch) is data parallelism, which the replicas already are. Which parameter an operator is
given is only known when it is called, so the trace records it (:func:`recording`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from autopar.errors import ConfigError


@dataclass
class Uses:
    """``splits``: parameter name -> (the operator that splits it, its split count per dimension)."""

    splits: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)  # one parameter given two strategies


@contextlib.contextmanager
def recording(network: torch.nn.Module, active: bool = True):
    """While the context lasts (the pipeline's trace), every operator with a strategy records the split its
    strategy gives each parameter it is called with (yields :class:`Uses`)."""
    from autopar.ops.math import ShardablePrimitive

    uses = Uses()
    if not active:
        yield uses
        return
    module_names = {id(m): n for n, m in network.named_modules()}
    seen: dict = {"first": None, "names": {}}  # the parameters' names by identity, for the tensors the trace holds

    def parameter_names() -> dict:
        """id -> name, made again only when the parameters were swapped (the trace swaps them all at once, for
        its own stand-ins): not once per operator call."""
        first = next(network.parameters(), None)
        if first is not seen["first"]:
            seen["first"], seen["names"] = first, {id(p): n for n, p in network.named_parameters()}
        return seen["names"]

    def record(op, args):
        strategy = getattr(op, "strategy", None)
        if strategy is None:
            return
        names = parameter_names()
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        for tensor, splits in zip(tensors, strategy):
            name = names.get(id(tensor))
            if name is None:
                continue
            who = module_names.get(id(op), type(op).__name__)
            splits = tuple(int(s) for s in splits)
            prev = uses.splits.setdefault(name, (who, splits))
            if prev[1] != splits:
                uses.conflicts.append(f"parameter '{name}' is split {prev[1]} by '{prev[0]}' and {splits} by '{who}'")

    hooks = [m.register_forward_pre_hook(record) for m in network.modules()
             if isinstance(m, ShardablePrimitive) and getattr(m, "strategy", None) is not None]
    try:
        yield uses
    finally:
        for h in hooks:
            h.remove()


def tensor_plan_of(uses: Uses, stage_ranks: int) -> tuple[int, dict, str | None]:
    """(tp, {parameter name: placement on the tensor group}, why not) from what the trace recorded: every weight a
    strategy splits, split on one dimension over the same number of ranks -- that number is the tensor group. Where
    the strategies cannot run so, (1, {}, the reason) and the stage runs whole on each rank (said by the caller)."""
    from torch.distributed.tensor import Shard

    if uses.conflicts:
        return 1, {}, uses.conflicts[0] + " (one parameter, one strategy)"
    split = {name: (who, s) for name, (who, s) in uses.splits.items() if any(n > 1 for n in s)}
    if not split:
        return 1, {}, None  # the batch only: the stage's replicas are that data parallelism
    plan, degrees = {}, {}
    for name, (who, s) in split.items():
        dims = [d for d, n in enumerate(s) if n > 1]
        if len(dims) > 1:
            return 1, {}, (f"'{who}' splits parameter '{name}' on {len(dims)} dimensions {s}; inside a stage a "
                           "weight splits on one (a column or a row split)")
        degrees.setdefault(s[dims[0]], (who, name))
        plan[name] = Shard(dims[0])
    if len(degrees) > 1:
        (a, (who_a, p_a)), (b, (who_b, p_b)) = list(degrees.items())[:2]
        return 1, {}, (f"'{who_a}' splits '{p_a}' over {a} ranks and '{who_b}' splits '{p_b}' over {b}; inside a "
                       "stage every split weight shares one tensor group")
    tp = next(iter(degrees))
    if stage_ranks % tp:
        who, name = degrees[tp]
        raise ConfigError(f"'{who}' splits parameter '{name}' over {tp} ranks, which do not divide the "
                          f"{stage_ranks} rank(s) of a pipeline stage (a strategy under pipeline_stages is written "
                          "for one stage's ranks)")
    return tp, plan, None


def sequence_entries(network: torch.nn.Module, tp: int) -> tuple[dict, str | None]:
    """({module name: "sequence"}, why not): the cells split on the sequence (``cell.shard(((dp, mp, 1),))``,
    ``autopar.shard(norm, "sequence")``), run on the rank's slice of the sequence over the stage's tensor group --
    Megatron's sequence parallelism beside the tensor split -- where they split dimension 1 over its ``tp`` ranks
    (the batch's split, dimension 0, is the replicas'). Where they cannot, ({}, the reason)."""
    plan = {}
    for name, module in network.named_modules():
        split = getattr(module, "_autopar_split", None)
        if split is None:
            continue
        kind, how = split
        dims = {1: tp} if kind == "sequence" and how == 1 else (
            {d: n for d, n in enumerate(how) if n > 1 and d > 0} if kind == "strategy" else {how: tp})
        if set(dims) != {1} or (tp > 1 and dims[1] != tp):
            return {}, (f"cell '{name}' is split {how if kind == 'strategy' else f'on dimension {how}'}; inside a "
                        f"stage a cell splits the sequence (dimension 1) over the tensor group of {tp}")
        if tp == 1:
            return {}, (f"cell '{name}' is split on the sequence, which runs beside a tensor split of the stage's "
                        "weights (Megatron's sequence parallelism) and no strategy splits one")
        plan[name] = "sequence"
    return plan, None
