"""A layout runtime's strategy files: ``strategy_ckpt_save_file`` written after the first forward (every parameter's
layout and every operator's strategy, by every rank), ``strategy_ckpt_load_file`` read before it -- its operator
strategies given to the operators that have none (MindSpore's distributed inference builds its network without
strategies and loads the training ones), its parameter layouts checked against what the operators then need."""
from __future__ import annotations

import warnings

import torch

from autopar.errors import StrategyError, user_stacklevel
from autopar.layout.layout import Layout
from autopar.layout.strategy_file import load_operator_strategies, load_strategy_file, save_strategy_file
from autopar.ops.math import ShardablePrimitive
from autopar.ops.shard import has_strategies, shard


class LoadedStrategy:
    """What ``strategy_ckpt_load_file`` says, for a job of ``world`` ranks. A file written for another device count
    keeps its layouts for resharding checkpoints but cannot run its operator strategies here: said once."""

    def __init__(self, path: str | None, world: int):
        self.path = path
        self.layouts: dict[str, Layout] = {}
        self.operators: dict[str, tuple] = {}
        if not path:
            return
        layouts = load_strategy_file(path)
        operators, written_for = load_operator_strategies(path)
        if written_for != world:
            warnings.warn(f"autopar: strategy file {path} was written for {written_for} devices, this job has "
                          f"{world}: its operator strategies are not applied (operators run data-parallel); "
                          "load_distributed_checkpoint still reshards the slices it describes", stacklevel=user_stacklevel())
            return
        self.layouts, self.operators = layouts, operators

    def apply(self, root: torch.nn.Module, names: dict[int, str]) -> None:
        """Give each operator of ``root`` the file names, and that has no strategy of its own, the file's."""
        for module in root.modules():
            strategy = self.operators.get(names.get(id(module), ""))
            if strategy is None or has_strategies(module):
                continue
            if isinstance(module, ShardablePrimitive):
                module.shard(strategy)
                module._autopar_strategy_file = self.path  # a strategy that does not fit is then the file's
            elif isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
                shard(module, strategy)
                module._autopar_op._autopar_strategy_file = self.path

    def check_shape(self, name: str, shape: tuple) -> None:
        """Parameter ``name`` must have the shape the file was written for (else the file is another network's)."""
        loaded = self.layouts.get(name)
        if loaded is not None and tuple(loaded.full_shape) != tuple(shape):
            raise StrategyError(f"the strategy file {self.path} was written for parameter '{name}' of shape "
                                f"{tuple(loaded.full_shape)}, the network's has {tuple(shape)}: the file is another "
                                f"network's (write it again with strategy_ckpt_save_file)")

    def check(self, name: str, shape: tuple, layout: Layout, who: str) -> None:
        """The file's layout of parameter ``name`` must be that of the operator using it, for this very shape."""
        loaded = self.layouts.get(name)
        if loaded is None:
            return
        self.check_shape(name, shape)
        if loaded.placements() != layout.placements():
            raise StrategyError(f"the strategy file {self.path} gives parameter '{name}' the layout {loaded} but "
                                f"{who} needs {layout}")


def operator_strategies(roots, names: dict[int, str]) -> dict[str, tuple]:
    """{name: strategy} of every operator (and ``autopar.shard``-ed module) with a strategy."""
    out = {}
    for root in roots:
        for module in root.modules():
            op = getattr(module, "_autopar_op", None) or (module if isinstance(module, ShardablePrimitive) else None)
            if op is not None and op.strategy is not None and id(module) in names:
                out[names[id(module)]] = tuple(tuple(s) for s in op.strategy)
    return out


def write_strategy_file(path: str, runtime) -> None:
    save_strategy_file(path, runtime.layouts(), runtime.parameters(), operator_strategies(runtime.roots,
                                                                                         runtime.names))
