"""``from mindspore.ops import operations as P`` path (older tutorials): the same operator classes."""
from autopar.ops.array import *  # noqa: F401,F403
from autopar.ops.comm import AllGather, AllReduce, AlltoAll, Broadcast, ReduceScatter  # noqa: F401
from autopar.ops.math import *  # noqa: F401,F403
