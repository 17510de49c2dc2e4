"""The MindSpore operator names the samples use beyond the shardable math: shape helpers, Print, comparisons,
GradOperation / HyperMap / MultitypeFuncGraph, and the function-style names."""
import numpy as np
import pytest
import torch

from autopar import ops
from autopar.ops import functional as F
from autopar.ops import operations as P


def test_shape_helpers_and_their_operations_path():
    x = torch.randn(2, 3, 4)
    assert ops.Flatten()(x).shape == (2, 12) and P.Flatten is ops.Flatten
    assert ops.ExpandDims()(x, 1).shape == (2, 1, 3, 4)
    assert ops.Concat(axis=1)((x, x)).shape == (2, 6, 4)
    assert ops.Shape()(x) == (2, 3, 4) and F.shape(x) == (2, 3, 4)
    assert torch.equal(ops.Fill()(torch.float32, (2, 2), 3.0), torch.full((2, 2), 3.0))
    assert torch.equal(ops.Select()(x > 0, x, torch.zeros_like(x)), x.clamp(min=0))
    out, mask = ops.Dropout(keep_prob=0.5)(torch.ones(1000))
    assert set(out.unique().tolist()) <= {0.0, 2.0} and abs(float(mask.mean()) - 0.5) < 0.1
    assert ops.Flatten.local and not ops.MatMul.local  # shape helpers never take a strategy


def test_print_writes_mindspores_format(capsys):
    ops.Print()("out is:", torch.tensor([[1.0, 2.0]]))
    out = capsys.readouterr().out
    assert out.startswith("out is:\nTensor(shape=[1, 2], dtype=Float32, value=\n[[1. 2.]]")


def test_comparisons_are_shardable_elementwise():
    a, b = torch.tensor([1, 2, 3]), torch.tensor([1, 0, 3])
    assert torch.equal(ops.NotEqual()(a, b), a != b)
    assert ops.NotEqual().shard(((2,), (2,))).strategy == ((2,), (2,))
    assert torch.equal(ops.LogicalOr()(a > 2, b > 0), (a > 2) | (b > 0))


def test_gather_picks_rows():
    table, idx = torch.arange(12.0).reshape(4, 3), torch.tensor([[3, 0], [1, 1]])
    assert torch.equal(ops.Gather()(table, idx, 0), table[idx])


def test_grad_operation_switches_match_autograd():
    w = torch.nn.Parameter(torch.tensor([2.0, 3.0]))

    def net(x, y):
        return (w * x * y).sum()

    x, y = torch.tensor([1.0, 4.0]), torch.tensor([5.0, 6.0])
    assert torch.equal(ops.GradOperation()(net)(x, y), w.detach() * y)
    gx, gy = ops.GradOperation(get_all=True)(net)(x, y)
    assert torch.equal(gy, w.detach() * x)
    (gw,) = ops.GradOperation(get_by_list=True)(net, [w])(x, y)
    assert torch.equal(gw, x * y)
    (gw2,) = ops.GradOperation(get_by_list=True, sens_param=True)(net, [w])(x, y, torch.tensor(2.0))
    assert torch.equal(gw2, 2 * x * y)


def test_hypermap_multitype_partial_depend():
    scale = ops.MultitypeFuncGraph("scale")

    @scale.register("Number", "Tensor")
    def _(k, t):
        return k * t

    grads = (torch.ones(2), torch.full((3,), 2.0))
    scaled = ops.HyperMap()(ops.partial(scale, 3.0), grads)
    assert torch.equal(scaled[0], torch.full((2,), 3.0)) and torch.equal(scaled[1], torch.full((3,), 6.0))
    with pytest.raises(Exception, match="no function registered"):
        scale("a", "b")
    assert ops.depend(grads[0], grads[1]) is grads[0]


def test_function_style_names():
    x = torch.randn(3, 4)
    assert torch.equal(ops.matmul(x, x.T), x @ x.T) and torch.equal(ops.relu(x), x.clamp(min=0))
    assert ops.reshape(x, (4, 3)).shape == (4, 3) and ops.cast(x, torch.float64).dtype == torch.float64
    assert torch.equal(ops.ones_like(x), torch.ones(3, 4)) and ops.dtype(x) == torch.float32
    b = torch.arange(4.0)
    assert torch.equal(ops.bias_add(x, b), x + b)
    p = torch.zeros(2)
    ops.assign(p, torch.ones(2))
    ops.assign_add(p, torch.ones(2))
    assert torch.equal(p, torch.full((2,), 2.0))
    assert np.array_equal(ops.fill(torch.int32, (2,), 7).numpy(), [7, 7])
