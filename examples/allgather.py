"""The GPU tutorial's all-gather sample (nccl_allgather.py), written for autopar.

    autopar launch -n 4 examples/allgather.py      # prints [[0.], [1.], [2.], [3.]]
    mpirun -n 4 python examples/allgather.py       # the same through OpenMPI

On a GPU machine ``init()`` picks NCCL (``init("nccl")`` works too); on CPU it uses gloo.
"""
import numpy as np

import autopar as ms
import autopar.nn as nn
import autopar.ops as ops
from autopar.communication import get_rank, init


class Net(nn.Cell):
    def __init__(self):
        super(Net, self).__init__()
        self.allgather = ops.AllGather()

    def construct(self, x):
        return self.allgather(x)


if __name__ == "__main__":
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    init()
    value = get_rank()
    input_x = ms.Tensor(np.array([[value]]).astype(np.float32))
    net = Net()
    output = net(input_x)
    # MindSpore prints its Tensor like numpy; show the gathered values the same way on one line
    print(np.array2string(output.numpy(), separator=", ").replace("\n", ""))
