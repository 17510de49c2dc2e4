"""``mindspore.nn.optim.sgd`` path."""
from autopar.nn.optim import SGD  # noqa: F401
