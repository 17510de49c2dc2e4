"""``mindspore.nn.wrap.cell_wrapper`` path (r2.2's gradient-accumulation sample imports ``GradAccumulationCell``
from here): the same wrappers as ``autopar.nn``."""
from autopar.nn.wrappers import (  # noqa: F401
    DistributedGradReducer,
    GradAccumulationCell,
    PipelineCell,
    TrainOneStepCell,
    WithLossCell,
)
