"""MindSpore-style ``nn``: ``Cell``, layers, losses, optimizers, wrappers (PyTorch modules underneath)."""
from autopar.errors import unsupported as _unsupported
from autopar.nn import transformer, utils, wrap  # noqa: F401  (mindspore.nn.transformer / utils / wrap paths)
from autopar.nn.basic import (  # noqa: F401
    ELU,
    GELU,
    CellList,
    Dropout,
    Flatten,
    Identity,
    LeakyReLU,
    LogSoftmax,
    ReLU,
    ReLU6,
    SequentialCell,
    Sigmoid,
    SiLU,
    Softmax,
    Tanh,
    get_activation,
)
from autopar.nn.cell import Cell  # noqa: F401
from autopar.nn.layers import (  # noqa: F401
    AdaptiveAvgPool2d,
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    Conv2d,
    Dense,
    Embedding,
    LayerNorm,
    MaxPool2d,
)
from autopar.nn.loss import (  # noqa: F401
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    L1Loss,
    MAELoss,
    MSELoss,
    NLLLoss,
    SmoothL1Loss,
    SoftmaxCrossEntropyExpand,
    SoftmaxCrossEntropyWithLogits,
)
from autopar.nn.optim import SGD, Adam, AdamWeightDecay, Momentum  # noqa: F401
from autopar.nn.wrap.loss_scale import (  # noqa: F401
    DynamicLossScaleUpdateCell,
    FixedLossScaleUpdateCell,
    TrainOneStepWithLossScaleCell,
)
from autopar.nn.wrappers import (  # noqa: F401
    DistributedGradReducer,
    GradAccumulationCell,
    PipelineCell,
    PipelineGradReducer,
    TrainOneStepCell,
    WithLossCell,
)

MicroBatchInterleaved = _unsupported(
    "nn.MicroBatchInterleaved", "it overlaps Ascend communication with compute; call the network as it is")
