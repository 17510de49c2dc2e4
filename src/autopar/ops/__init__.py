"""MindSpore-style operators (``autopar.ops``): communication ops and shardable compute ops."""
from autopar.comm.functional import ReduceOp  # noqa: F401
from autopar.ops import functional, operations  # noqa: F401,E402  (MindSpore's P / F module paths)
from autopar.ops.comm import AllGather, AllReduce, AlltoAll, Broadcast, ReduceScatter  # noqa: F401
from autopar.ops.grad import grad, value_and_grad  # noqa: F401
from autopar.ops.math import (  # noqa: F401
    GELU,
    Add,
    BatchMatMul,
    BiasAdd,
    Cast,
    Div,
    Exp,
    GeLU,
    Log,
    LogSoftmax,
    MatMul,
    Maximum,
    Minimum,
    Mul,
    Neg,
    OneHot,
    RealDiv,
    ReduceMax,
    ReduceMean,
    ReduceMin,
    ReduceSum,
    ReLU,
    Reshape,
    ShardablePrimitive,
    Sigmoid,
    Softmax,
    Sqrt,
    Square,
    Squeeze,
    Sub,
    Tanh,
    Transpose,
    scalar_to_array,
    scalar_to_tensor,
    shape,
)
from autopar.ops.primitive import Primitive  # noqa: F401
