"""autopar: MindSpore-style distributed parallel training for PyTorch.

Two doors, one house: the MindSpore names (``autopar.communication.init``, ``autopar.set_auto_parallel_context``,
``autopar.train.Model`` ...) are thin aliases over the PyTorch-native core in the sub-packages. Heavier parts
(training, parallel runtime, checkpoints) load on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

from autopar import context, dtype  # noqa: F401
from autopar.comm.management import (  # noqa: F401
    create_group,
    get_group_size,
    get_local_rank,
    get_local_size,
    get_rank,
    init,
    release,
)
from autopar.common.tensor import Parameter, Tensor  # noqa: F401
from autopar.context import (  # noqa: F401
    GRAPH_MODE,
    PYNATIVE_MODE,
    ParallelMode,
    get_auto_parallel_context,
    get_context,
    get_ps_context,
    reset_auto_parallel_context,
    set_auto_parallel_context,
    set_context,
    set_device,
    set_ps_context,
)
from autopar.dtype import (  # noqa: F401
    bfloat16,
    bool_,
    float16,
    float32,
    float64,
    int8,
    int16,
    int32,
    int64,
    uint8,
)
from autopar.errors import AutoparError, install_excepthook  # noqa: F401

# An uncaught autopar error (bad input, a failed rank) prints as one line -- from the first call of a script,
# before init() -- instead of a traceback through autopar's internals; AUTOPAR_TRACEBACK=1 keeps the traceback.
install_excepthook()

__version__ = "0.1.0"


def _install_first_call_hooks() -> None:
    """A network parallelizes itself on its first call in a parallel mode (``autopar.parallel.entry``)."""
    from autopar.parallel.entry import install

    install()


def _remove_first_call_hooks() -> None:
    import sys

    entry = sys.modules.get("autopar.parallel.entry")  # never installed: nothing to remove (and nothing to import)
    if entry is not None:
        entry.uninstall()


# inert until a parallel mode is set: torch's global hooks are installed then, and removed on reset
context.on_parallel_mode(_install_first_call_hooks)
context.on_reset(_remove_first_call_hooks)

# name -> "module:attribute", imported on first access (PEP 562)
_LAZY = {
    "Model": "autopar.train.model:Model",
    "connect_network_with_dataset": "autopar.train.train_thor.dataset_helper:connect_network_with_dataset",
    "LossMonitor": "autopar.train.callbacks:LossMonitor",
    "TimeMonitor": "autopar.train.callbacks:TimeMonitor",
    "ModelCheckpoint": "autopar.train.checkpointing:ModelCheckpoint",
    "CheckpointConfig": "autopar.train.checkpointing:CheckpointConfig",
    "shard": "autopar.parallel.api:shard",
    "value_and_grad": "autopar.ops.grad:value_and_grad",
    "grad": "autopar.ops.grad:grad",
    "parallelize": "autopar.parallel.api:parallelize",
    "deferred_init": "autopar.common.deferred:deferred_init",
    "PipelineParallel": "autopar.parallel.pipeline:PipelineParallel",
    "load_checkpoint": "autopar.checkpoint.api:load_checkpoint",
    "save_checkpoint": "autopar.checkpoint.api:save_checkpoint",
    "load_param_into_net": "autopar.checkpoint.api:load_param_into_net",
    "load_distributed_checkpoint": "autopar.checkpoint.api:load_distributed_checkpoint",
    "merge_sliced_checkpoints": "autopar.checkpoint.api:merge_sliced_checkpoints",
    "set_seed": "autopar.seed:set_seed",
    "get_seed": "autopar.seed:get_seed",
    "jit": "autopar.common.api:jit",
    "lazy_inline": "autopar.common.api:lazy_inline",
    "ms_function": "autopar.common.api:jit",
    "ParameterTuple": "autopar.common.tensor:ParameterTuple",
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        if name in ("nn", "ops", "dataset", "train", "models", "parallel", "checkpoint", "communication", "comm",
                    "common", "runtime"):
            return importlib.import_module(f"autopar.{name}")
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    module, attr = target.split(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
