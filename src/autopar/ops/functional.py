"""``import mindspore.ops.functional as F`` path: ``F.shape``, ``F.scalar_to_array``, ``F.scalar_to_tensor``."""
from autopar.ops.math import scalar_to_array, scalar_to_tensor, shape  # noqa: F401
