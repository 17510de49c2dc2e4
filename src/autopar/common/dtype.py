"""``import autopar.common.dtype as mstype`` (MindSpore path) -- the same objects as :mod:`autopar.dtype`."""
from autopar.dtype import *  # noqa: F401,F403
from autopar.dtype import __all__  # noqa: F401


def pytype_to_dtype(obj):
    """MindSpore's ``pytype_to_dtype(numpy type)``: the torch dtype of that numpy type."""
    import numpy as np
    import torch

    if isinstance(obj, torch.dtype):
        return obj
    return torch.from_numpy(np.empty(0, dtype=np.dtype(obj))).dtype
