"""``mindspore.common`` door: ``dtype``, ``Tensor``, ``Parameter``, ``initializer``, ``jit``."""
from autopar import dtype  # noqa: F401
from autopar.common import initializer  # noqa: F401
from autopar.common.api import jit, lazy_inline  # noqa: F401
from autopar.common.tensor import Parameter, ParameterTuple, Tensor  # noqa: F401
