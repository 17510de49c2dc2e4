"""Checkpoints: integrated (full tensors, one file) and sliced (each rank's slices, resharded on load by
torch.distributed.checkpoint), strategy layouts, resume, and MindSpore ``.ckpt`` interop."""
from autopar.checkpoint.api import (  # noqa: F401
    load_checkpoint,
    load_distributed_checkpoint,
    load_param_into_net,
    merge_sliced_checkpoints,
    save_checkpoint,
)
