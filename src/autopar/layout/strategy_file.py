"""Strategy files (``strategy_ckpt_save_file`` / ``strategy_ckpt_load_file``): every parameter's layout as JSON,
so a checkpoint's slices can be put back together or resharded by a run that never saw the network's strategies."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from autopar.errors import CheckpointError, StrategyError
from autopar.layout.axes import current_world_size as world_size
from autopar.layout.layout import Layout

STRATEGY_FORMAT = "autopar-strategy-1"


def save_strategy_file(path: str, layouts: dict[str, Layout], named_params) -> None:
    """JSON: for every parameter, full shape, device matrix, tensor map (axes counted from the left, -1 = not
    split) and slice shape. Written by rank 0, atomically."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    params = {}
    for name, p in named_params:
        entry = layouts[name].to_dict() if name in layouts else {"full_shape": None, "slice_shape": list(p.shape)}
        entry["dtype"] = str(p.dtype).replace("torch.", "")
        entry["layerwise_parallel"] = bool(getattr(p, "layerwise_parallel", False))
        params[name] = entry
    doc = {"format": STRATEGY_FORMAT, "device_num": world_size(),
           "tensor_map_convention": "per tensor dimension, the device-matrix axis (counted from the left) that "
                                    "splits it; -1 = not split; ranks are row-major on the device matrix",
           "parameters": params}
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, target)


def load_strategy_file(path: str) -> dict[str, Layout]:
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"strategy file not found: {path}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"strategy file {path} is not readable JSON: {exc}") from None
    if doc.get("format") != STRATEGY_FORMAT:
        raise CheckpointError(f"{path} is not an autopar strategy file (format {doc.get('format')!r})")
    try:
        return {name: Layout.from_dict(e) for name, e in doc["parameters"].items() if e.get("full_shape") is not None}
    except (KeyError, TypeError, StrategyError) as exc:
        raise CheckpointError(f"strategy file {path} is malformed: {exc}") from None
