"""MindSpore-style ``nn``: ``Cell``, losses, optimizers, wrappers (PyTorch modules underneath)."""
from autopar.nn.cell import Cell  # noqa: F401
from autopar.nn.loss import SoftmaxCrossEntropyExpand, SoftmaxCrossEntropyWithLogits  # noqa: F401
from autopar.nn.optim import SGD, Adam, AdamWeightDecay, Momentum  # noqa: F401
from autopar.nn.wrappers import DistributedGradReducer, PipelineCell, TrainOneStepCell, WithLossCell  # noqa: F401
