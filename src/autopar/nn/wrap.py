"""``mindspore.nn.wrap`` path (``from mindspore.nn.wrap import TrainOneStepCell``): the same wrappers as ``autopar.nn``."""
from autopar.nn.wrappers import (  # noqa: F401
    DistributedGradReducer,
    PipelineCell,
    TrainOneStepCell,
    WithLossCell,
)
