"""``mindspore.train.callback`` path (MindSpore 1.x scripts: ``from mindspore.train.callback import LossMonitor``):
the same callbacks as ``autopar.train``."""
from autopar.train.callbacks import Callback, CallbackParams, LossMonitor, RunContext, TimeMonitor  # noqa: F401
from autopar.train.checkpointing import CheckpointConfig, ModelCheckpoint  # noqa: F401
