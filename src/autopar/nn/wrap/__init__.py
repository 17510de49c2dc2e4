"""``mindspore.nn.wrap`` path (``from mindspore.nn.wrap import TrainOneStepCell``): the same wrappers as ``autopar.nn``;
``mindspore.nn.wrap.loss_scale`` / ``.cell_wrapper`` are :mod:`autopar.nn.wrap.loss_scale` / ``.cell_wrapper``."""
from autopar.nn.wrap import cell_wrapper, loss_scale  # noqa: F401
from autopar.nn.wrap.loss_scale import (  # noqa: F401
    DynamicLossScaleUpdateCell,
    FixedLossScaleUpdateCell,
    TrainOneStepWithLossScaleCell,
)
from autopar.nn.wrappers import (  # noqa: F401
    DistributedGradReducer,
    PipelineCell,
    TrainOneStepCell,
    WithLossCell,
)
