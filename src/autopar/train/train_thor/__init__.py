"""``mindspore.train.train_thor`` path (r1.3's gradient-accumulation sample imports its ``DatasetHelper``): the names
load, and stop at first use with the supported way (``Model(..., grad_accumulation_steps=k)``)."""
from autopar.train.train_thor import dataset_helper  # noqa: F401
