"""One line per network that says how it trains: the mode, the mesh, ZeRO, which modules are split and how, the
gradient engine and AUTO's choice.

A user who changes ``parallel_mode``, adds ``autopar.shard(net[0], "colwise")`` or turns on ZeRO-3 must see that the
change did something: without this line every one of those jobs prints the same launch line and the script's own
output. Rank 0 prints it when the network's layout is known (after :func:`autopar.parallel.api.attach`, or after
the first forward where layouts are chosen there) and appends it to ``LOG_DIR/parallel.txt``.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from autopar import context as _context
from autopar.comm import management as _comm

_SHOWN_SPLITS = 8  # split modules named in the line; the rest are counted
_ZERO_SHARDS = {"1": "optimizer state", "2": "gradients and optimizer state",
                "3": "parameters, gradients and optimizer state"}


def split_modules(network: torch.nn.Module) -> list[str]:
    """``name (Type) how`` for every module or operator that carries a shard strategy, in the user's spelling where
    there is one (``"colwise"``), else the strategy tuple."""
    from autopar.ops.math import ShardablePrimitive

    out = []
    for name, m in network.named_modules():
        op = getattr(m, "_autopar_op", None)
        if op is not None:
            how = getattr(m, "_autopar_style", None) or op.strategy
            out.append(f"{name or 'the network'} ({type(m).__name__.removeprefix('Sharded')}) {_spelled(how)}")
        elif isinstance(m, ShardablePrimitive) and m.strategy is not None and not name.endswith("_autopar_op"):
            out.append(f"{name} ({type(m).__name__}) {_spelled(m.strategy)}")
        elif getattr(m, "_autopar_experts", False):
            degree = m._autopar_experts
            over = "" if degree is True else f" over groups of {degree} ranks"
            out.append(f"{name} ({type(m).__name__.removeprefix('ExpertParallel')}) {_spelled('expert')}{over}")
    return out


def _spelled(how) -> str:
    return f'"{how}"' if isinstance(how, str) else str(tuple(tuple(s) for s in how))


def _tensor_parallel(runtime) -> int:
    """The most ways one parameter is split by its layout (what a user calls the TP degree); 1 where none is."""
    return max((math.prod(layout.full_shape) // max(1, math.prod(layout.slice_shape))
                for _who, _placements, layout in runtime.param_layout.values()), default=1)


def _context_parallel(runtime) -> int:
    """Over how many ranks the inputs' sequence is split (1: not split)."""
    if runtime is None or not getattr(runtime, "sequence_split", False):
        return 1
    if runtime.context_parallel > 1:
        return runtime.context_parallel
    return max((int(e[1]) for e in runtime.dataset_strategy or () if isinstance(e, (tuple, list)) and len(e) > 1),
               default=1)


def describe(state, network: torch.nn.Module) -> str:
    """The line, without the ``[autopar]`` mark."""
    world = state.world
    pp = getattr(state.pipeline, "num_stages", 1) if state.pipeline is not None else 1
    tp = _tensor_parallel(state.runtime) if state.runtime is not None else getattr(state.pipeline, "tp", 1)
    cp = _context_parallel(state.runtime)
    dp = max(1, world // (pp * tp * cp))
    parts = [f"{state.mode.value} on {world} rank{'s' if world != 1 else ''}: mesh dp {dp} x "
             + (f"cp {cp} x " if cp > 1 else "") + f"tp {tp} x pp {pp}"]
    if cp > 1:
        parts.append(f"the sequence split over {cp} ranks (context parallelism, attention by "
                     f"{state.runtime.context_parallel_algo})")
    staged = getattr(state.pipeline, "zero", None) if state.pipeline is not None else None
    zero = state.zero_level or getattr(state.runtime, "zero_level", None) or staged
    if zero:
        level = str(zero).removeprefix("level")
        parts.append(f"ZeRO-{level} ({_ZERO_SHARDS.get(level, 'optimizer state')} sharded over {dp} ranks"
                     + (", inside each pipeline stage)" if staged else ")"))
    else:
        parts.append("no ZeRO")
    splits = split_modules(network)
    if splits:
        more = f", and {len(splits) - _SHOWN_SPLITS} more" if len(splits) > _SHOWN_SPLITS else ""
        parts.append("split: " + ", ".join(splits[:_SHOWN_SPLITS]) + more)
    elif state.runtime is None and state.pipeline is None and not zero:
        parts.append("every parameter whole on every rank")
    if state.pipeline is not None:
        runner = state.pipeline
        parts.append(f"pipeline: {pp} stages, {getattr(runner, 'micro_batches', '?')} micro-batches, "
                     f"{getattr(runner, 'schedule_name', '?')}")
    engines = state.gradient_engines() if state.engines or state.pipeline is None else None
    parts.append(f"gradients: {engines or getattr(state.pipeline, 'gradient_sync', 'the pipeline engine')}")
    if state.plan is not None:
        parts.append(f"chosen by AUTO_PARALLEL (why: {Path(_context.log_dir()) / 'auto_parallel_plan.txt'})")
    return "; ".join(parts)


def announce(state, network: torch.nn.Module) -> None:
    """Rank 0 prints the line once per network and appends it to ``LOG_DIR/parallel.txt``."""
    if state.announced or _context.is_managed():
        return
    state.announced = True
    if _comm.is_initialized() and _comm.get_rank() != 0:
        return
    line = describe(state, network)
    print(f"[autopar] {line}", flush=True)
    try:
        path = Path(_context.log_dir()) / "parallel.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fh.write(line + "\n")
    except OSError:
        pass  # the console has it; a log directory that cannot be written is reported where logs are written
