"""``mindspore.communication.comm_func`` (MindSpore 2.4+): collectives as functions, the same as ``autopar.comm``."""
from autopar.comm.functional import (  # noqa: F401
    ReduceOp,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    reduce_scatter,
)

all_gather_into_tensor = all_gather
reduce_scatter_tensor = reduce_scatter
