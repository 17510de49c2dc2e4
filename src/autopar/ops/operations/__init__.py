"""``from mindspore.ops import operations as P`` path (older tutorials): the same operator classes."""
from autopar.ops.array import *  # noqa: F401,F403
from autopar.ops.comm import AllGather, AllReduce, AlltoAll, Broadcast, ReduceScatter  # noqa: F401
from autopar.ops.math import *  # noqa: F401,F403
from autopar.ops.math import Add as TensorAdd  # noqa: F401,E402  (MindSpore r0.x's name of Add)
from autopar.ops.operations import comm_ops  # noqa: F401,E402  (mindspore.ops.operations.comm_ops)
