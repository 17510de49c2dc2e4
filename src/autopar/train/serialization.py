"""``mindspore.train.serialization`` path (``from mindspore.train.serialization import load_checkpoint``): the same
functions as ``autopar.checkpoint``."""
from autopar.checkpoint.api import (  # noqa: F401
    load_checkpoint,
    load_distributed_checkpoint,
    load_param_into_net,
    merge_sliced_checkpoints,
    save_checkpoint,
)
