"""``Cell``: MindSpore's network base class as a ``torch.nn.Module`` whose ``forward`` calls ``construct``.

MindSpore compiles a Cell for the parallel context on its first call; autopar parallelizes any module -- Cell or
plain torch -- on its first call (``autopar.parallel.entry``), so a Cell needs nothing of its own for that.

The MindSpore layers (``nn.Dense``, ``nn.Conv2d`` ...) are subclasses of both ``Cell`` and the torch module they
are (``torch.nn.Linear`` ...): ``isinstance(dense, nn.Cell)`` holds, every Cell method below works on them, and the
parallel runtime and the AUTO planner still see a ``torch.nn.Linear``. Such a layer calls its torch base's
``__init__`` itself and keeps the torch ``forward`` (see :func:`torch_forward`).
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from autopar.errors import refuses, warn_once


class Cell(torch.nn.Module):
    def __init__(self, auto_prefix: bool = True, flags: Any = None) -> None:
        super().__init__()
        if flags:
            self.add_flags(**flags)

    def construct(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must define construct()")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.construct(*args, **kwargs)

    # MindSpore spellings of torch.nn.Module methods ---------------------------------------------------------
    def get_parameters(self, expand: bool = True) -> Iterator[torch.nn.Parameter]:
        return self.parameters(recurse=expand)

    def trainable_params(self, recurse: bool = True) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters(recurse) if p.requires_grad]

    def untrainable_params(self, recurse: bool = True) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters(recurse) if not p.requires_grad]

    def parameters_dict(self, recurse: bool = True) -> dict[str, torch.nn.Parameter]:
        return dict(self.named_parameters(recurse=recurse))

    def parameters_and_names(self, name_prefix: str = "", expand: bool = True):
        return self.named_parameters(prefix=name_prefix, recurse=expand)

    def cells_and_names(self):
        return self.named_modules()

    def cells(self):
        return self.children()

    def name_cells(self) -> dict[str, torch.nn.Module]:
        return dict(self.named_children())

    def insert_child_to_cell(self, child_name: str, child_cell: torch.nn.Module) -> None:
        self.add_module(child_name, child_cell)

    def insert_param_to_cell(self, param_name: str, param: torch.nn.Parameter, check_name_contain_dot: bool = True):
        self.register_parameter(param_name, param)

    def set_train(self, mode: bool = True) -> "Cell":
        return self.train(mode)

    def set_grad(self, requires_grad: bool = True) -> "Cell":
        return self

    def set_inputs(self, *inputs: Any, **kwargs: Any) -> "Cell":
        """MindSpore declares dynamic input shapes for graph compilation; eager PyTorch takes any shape."""
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        params = self.__dict__.get("_parameters")
        if (params is not None and params.get(name) is not None and isinstance(value, torch.Tensor)
                and not isinstance(value, torch.nn.Parameter)):
            with torch.no_grad():  # MindSpore: a tensor assigned to a Parameter attribute is an Assign
                params[name].copy_(value.reshape(params[name].shape) if value.numel() == params[name].numel()
                                   else value)
            return
        super().__setattr__(name, value)

    def add_flags(self, **flags: Any) -> "Cell":
        """MindSpore's cell flags: stored (``get_flags``) and set as attributes, as MindSpore does (its own cells read
        them: ``self.accumulation``). ``accumulation`` acts -- an accumulation step's gradients are not yet applied,
        see :mod:`autopar.common.accumulation`; the others are graph-compiler hints and are warned about once."""
        self.__dict__.setdefault("_ms_flags", {}).update(flags)
        for name, value in flags.items():
            if name not in self._parameters and name not in self._modules and name not in self._buffers:
                self.__dict__[name] = value
        hints = [name for name in flags if name != "accumulation"]
        if hints:
            warn_once("Cell.add_flags", f"Cell.add_flags({', '.join(hints)}) is accepted: the flags are MindSpore "
                      f"graph-compiler hints and change nothing here")
        return self

    def add_flags_recursive(self, **flags: Any) -> "Cell":
        for module in self.modules():
            if isinstance(module, Cell):
                module.add_flags(**flags)
        return self

    def get_flags(self) -> dict:
        return dict(self.__dict__.get("_ms_flags", {}))

    def recompute(self, mode: bool = True, output_recompute: bool = False, **kwargs: Any) -> "Cell":
        """Activation checkpointing: this cell's forward keeps only its inputs and runs again in the backward
        (``torch.utils.checkpoint``, ``use_reentrant=False``); ``recompute(False)`` undoes it. As in MindSpore the
        result and gradients are unchanged. Unlike MindSpore, a BatchNorm inside runs twice in training mode, so its
        moving statistics are updated twice per step. MindSpore's communication-recompute switches
        (``parallel_optimizer_comm_recompute``, ``mp_comm_recompute``, ...) are accepted and warned about."""
        if kwargs or output_recompute:
            warn_once("Cell.recompute.options", f"Cell.recompute({', '.join(list(kwargs) + (['output_recompute'] if output_recompute else []))}=...)"
                      " is accepted: the cell is recomputed as a whole, communication included")
        set_recompute(self, mode)
        return self

    def set_comm_fusion(self, fusion_type: int, recurse: bool = True) -> "Cell":
        """MindSpore's fusion group of this cell's gradient all-reduces. Gradients here travel in size buckets
        (DDP's, or ``set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "size", "config": MB}})``), not
        by index: the index is stored (``comm_fusion`` of each parameter) and warned about once."""
        if isinstance(fusion_type, bool) or not isinstance(fusion_type, int) or fusion_type < 0:
            from autopar.errors import ConfigError

            raise ConfigError(f"set_comm_fusion: fusion_type must be a non-negative integer, got {fusion_type!r}")
        for param in self.parameters(recurse=recurse):
            param.comm_fusion = fusion_type
        warn_once("Cell.set_comm_fusion", "Cell.set_comm_fusion(...) is accepted: gradients are all-reduced in size "
                  "buckets, not by fusion index (comm_fusion={'allreduce': {'mode': 'size', 'config': MB}} sets the "
                  "bucket size)")
        return self

    def shard(self, in_strategy: Any = None, out_strategy: Any = None, parameter_plan: Any = None,
              device: str = "Ascend", level: int = 0) -> "Cell":
        """``cell.shard(((dp, mp, 1),))`` on a cell without children (a LayerNorm, a Dropout): it runs on its input
        split so -- sequence parallelism, MindFormers' ``use_seq_parallel`` layout (:func:`autopar.ops.shard.split_leaf`).
        Other cells: shard the operators inside (one line says how)."""
        from autopar.errors import UnsupportedError
        from autopar.ops.shard import split_leaf

        if (any(True for _ in self.children()) or out_strategy is not None or parameter_plan is not None
                or not isinstance(in_strategy, (tuple, list)) or len(in_strategy) != 1):
            raise UnsupportedError(
                "Cell.shard is available in autopar for a cell without children given one input strategy (a norm or "
                "dropout split on the sequence: cell.shard(((dp, mp, 1),))): shard the operators inside "
                "(ops.MatMul().shard(...)) or Dense/Conv2d with autopar.shard(module, strategy), under "
                "set_auto_parallel_context(parallel_mode='semi_auto_parallel')")
        if device != "Ascend" or level != 0:
            warn_once("Cell.shard-device", f"Cell.shard(device={device!r}, level={level!r}) is accepted and not "
                      "applied: the split runs on the job's devices")
        return split_leaf(self, in_strategy)

    @refuses("Cell.set_param_ps", "parameter-server training is not part of autopar; use data parallel "
             "(set_auto_parallel_context(parallel_mode='data_parallel'))")
    def set_param_ps(self, *args, **kwargs): ...


# Cell's methods for the MindSpore layers that subclass a torch module (nn.Dense(Cell, torch.nn.Linear) ...)
def torch_forward(torch_class: type):
    """``forward`` of a layer class ``(Cell, torch_class)``: the torch module's own (Cell.forward would look for
    ``construct``), and ``construct`` the same, so ``layer.construct(x)`` works as in MindSpore."""
    return torch_class.forward


def _recomputed_forward(module: torch.nn.Module):
    def forward(*args: Any, **kwargs: Any) -> Any:
        run = type(module).forward  # looked up per call: a class set later (autopar.shard) is followed
        if not torch.is_grad_enabled():
            return run(module, *args, **kwargs)
        return checkpoint(run, module, *args, use_reentrant=False, **kwargs)

    forward._autopar_recompute = True
    return forward


def set_recompute(module: torch.nn.Module, mode: bool = True) -> None:
    """Turn activation checkpointing of ``module``'s forward on or off (an instance ``forward``, so the module keeps
    its class, parameters and state dict)."""
    current = module.__dict__.get("forward")
    if mode and not getattr(current, "_autopar_recompute", False):
        module.forward = _recomputed_forward(module)
    elif not mode and getattr(current, "_autopar_recompute", False):
        del module.forward
