"""Strategy files (``strategy_ckpt_save_file`` / ``strategy_ckpt_load_file``): every parameter's layout and every
operator's shard strategy as JSON, so a checkpoint's slices can be put back together or resharded, and a network
built without strategies (MindSpore's distributed-inference script) runs with the ones it was trained with."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from autopar.errors import CheckpointError, StrategyError
from autopar.layout.axes import current_world_size as world_size
from autopar.layout.layout import Layout

STRATEGY_FORMAT = "autopar-strategy-1"


def save_strategy_file(path: str, layouts: dict[str, Layout], named_params, operators: dict | None = None) -> None:
    """JSON: for every parameter, full shape, device matrix, tensor map (axes counted from the left, -1 = not
    split) and slice shape; for every operator given a strategy, that strategy (by its name in the network).
    Written by every rank -- each may run in a directory of its own (MindSpore's ``device$i`` layout) -- atomically,
    so ranks sharing one path write the same bytes in turn."""
    params = {}
    for name, p in named_params:
        entry = layouts[name].to_dict() if name in layouts else {"full_shape": None, "slice_shape": list(p.shape)}
        entry["dtype"] = str(p.dtype).replace("torch.", "")
        entry["layerwise_parallel"] = bool(getattr(p, "layerwise_parallel", False))
        params[name] = entry
    doc = {"format": STRATEGY_FORMAT, "device_num": world_size(),
           "tensor_map_convention": "per tensor dimension, the device-matrix axis (counted from the left) that "
                                    "splits it; -1 = not split; ranks are row-major on the device matrix",
           "parameters": params,
           "operators": {name: [list(s) for s in strategy] for name, strategy in sorted((operators or {}).items())}}
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = target.with_name(target.name + f".tmp{os.getpid()}.{rank}")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, target)


def read_strategy_file(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"strategy file not found: {path}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"strategy file {path} is not readable JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != STRATEGY_FORMAT:
        raise CheckpointError(f"{path} is not an autopar strategy file (format "
                              f"{doc.get('format') if isinstance(doc, dict) else None!r})")
    return doc


def load_strategy_file(path: str) -> dict[str, Layout]:
    """Every parameter's layout in the file."""
    doc = read_strategy_file(path)
    try:
        return {name: Layout.from_dict(e) for name, e in doc["parameters"].items() if e.get("full_shape") is not None}
    except (KeyError, TypeError, StrategyError) as exc:
        raise CheckpointError(f"strategy file {path} is malformed: {exc}") from None


def load_operator_strategies(path: str) -> tuple[dict[str, tuple], int]:
    """``({operator name: strategy}, the device count the file was written for)``."""
    doc = read_strategy_file(path)
    try:
        ops = {name: tuple(tuple(int(v) for v in s) for s in strategy)
               for name, strategy in (doc.get("operators") or {}).items()}
        return ops, int(doc.get("device_num") or 1)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"strategy file {path} has malformed operator strategies: {exc}") from None
