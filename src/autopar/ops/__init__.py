"""MindSpore-style operators (``autopar.ops``): communication ops now; shardable compute ops in their modules."""
from autopar.comm.functional import ReduceOp  # noqa: F401
from autopar.ops.comm import AllGather, AllReduce, AlltoAll, Broadcast, ReduceScatter  # noqa: F401
from autopar.ops.primitive import Primitive  # noqa: F401
