"""Training: ``Model`` (train / eval / predict) and callbacks, MindSpore's ``mindspore.train`` door."""
from autopar.train.callbacks import (  # noqa: F401
    Callback,
    CallbackParams,
    LossMonitor,
    RunContext,
    TimeMonitor,
)
from autopar.train.checkpointing import CheckpointConfig, ModelCheckpoint  # noqa: F401
from autopar.train.metrics import Accuracy, Loss, Metric, TopKCategoricalAccuracy  # noqa: F401
from autopar.train.model import Model  # noqa: F401
