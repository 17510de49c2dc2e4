"""``mindspore.nn.optim.momentum`` path (MindSpore r0.x tutorials: ``from mindspore.nn.optim.momentum import Momentum``)."""
from autopar.nn.optim import Momentum  # noqa: F401
