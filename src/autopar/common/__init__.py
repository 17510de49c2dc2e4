"""``mindspore.common`` door: ``dtype``, ``Tensor``, ``Parameter``."""
from autopar import dtype  # noqa: F401
from autopar.common.tensor import Parameter, Tensor  # noqa: F401
