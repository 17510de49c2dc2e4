"""``mindspore.nn.optim.adam`` path."""
from autopar.nn.optim import Adam, AdamWeightDecay  # noqa: F401
