"""MindSpore's layers: their defaults against MindSpore's documented behaviour, and still the torch modules the
parallel runtime and the planner know (``autopar.shard`` keeps working on them)."""
import math
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar import nn
from autopar.errors import ConfigError


def test_dense_is_a_cell_and_a_linear_with_mindspore_defaults():
    torch.manual_seed(0)
    dense = nn.Dense(256, 64)
    assert isinstance(dense, nn.Cell) and isinstance(dense, torch.nn.Linear)
    assert tuple(dense.weight.shape) == (64, 256)  # (out, in), as MindSpore's
    bound = 1 / math.sqrt(256)  # HeUniform(sqrt(5)) and Uniform(1/sqrt(in)): MindSpore 2.x defaults
    assert dense.weight.abs().max() <= bound and dense.weight.abs().max() > 0.9 * bound
    assert dense.bias.abs().max() <= bound
    normal = nn.Dense(256, 512, weight_init="normal", bias_init="zeros")
    assert abs(float(normal.weight.detach().std()) - 0.01) < 0.0005 and float(normal.bias.detach().abs().max()) == 0.0
    assert nn.Dense(3, 2, has_bias=False).bias is None
    x = torch.randn(4, 3)
    relu = nn.Dense(3, 2, activation="relu")
    assert torch.equal(relu(x), torch.relu(F.linear(x, relu.weight, relu.bias)))
    assert torch.equal(relu.construct(x), relu(x))


def test_shard_still_works_on_dense_and_conv2d():
    dense = nn.Dense(8, 6)
    x = torch.randn(3, 8)
    expected = dense(x)
    sharded = autopar.shard(dense, ((1, 1), (2, 1)))
    assert sharded is dense and isinstance(dense, nn.Dense) and dense._autopar_op.strategy == ((1, 1), (2, 1), (2,))
    assert torch.equal(dense(x), expected)  # outside a parallel runtime: the module's own forward
    conv = nn.Conv2d(3, 4, 3, stride=2)  # pad_mode "same": the sharded forward keeps the asymmetric padding
    img = torch.randn(2, 3, 8, 8)
    before = conv(img)
    autopar.shard(conv, ((1, 1, 1, 1), (2, 1, 1, 1)))
    assert torch.equal(conv(img), before) and before.shape == (2, 4, 4, 4)


@pytest.mark.parametrize("size,kernel,stride,dilation", [(7, 3, 2, 1), (8, 3, 2, 1), (9, 4, 3, 1), (8, 3, 1, 2),
                                                         (5, 1, 2, 1)])
def test_conv2d_pad_modes_give_mindsporess_shapes_and_values(size, kernel, stride, dilation):
    x = torch.randn(2, 3, size, size)
    same = nn.Conv2d(3, 5, kernel, stride=stride, dilation=dilation)
    assert same.pad_mode == "same" and same.bias is None  # MindSpore's defaults
    out = same(x)
    assert out.shape[-1] == math.ceil(size / stride)  # "same": ceil(in / stride), for any stride
    eff = (kernel - 1) * dilation + 1
    total = max((out.shape[-1] - 1) * stride + eff - size, 0)
    manual = F.conv2d(F.pad(x, (total // 2, total - total // 2) * 2), same.weight, None, stride, 0, dilation)
    assert torch.allclose(out, manual, atol=1e-6)  # the odd extra row/column at the bottom/right
    valid = nn.Conv2d(3, 5, kernel, stride=stride, pad_mode="valid", dilation=dilation)
    assert valid(x).shape[-1] == (size - eff) // stride + 1


def test_conv2d_pad_mode_pad_takes_four_sides_and_rejects_padding_elsewhere():
    conv = nn.Conv2d(1, 1, 3, pad_mode="pad", padding=(1, 2, 0, 1), has_bias=True)
    x = torch.randn(1, 1, 6, 6)
    assert conv(x).shape == (1, 1, 7, 5)
    assert torch.allclose(conv(x), F.conv2d(F.pad(x, (0, 1, 1, 2)), conv.weight, conv.bias), atol=1e-6)
    with pytest.raises(ConfigError, match="needs pad_mode='pad'"):
        nn.Conv2d(1, 1, 3, padding=1)
    with pytest.raises(ConfigError, match="pad_mode must be"):
        nn.Conv2d(1, 1, 3, pad_mode="SAME_UPPER")
    with pytest.raises(ConfigError, match="NHWC"):
        nn.Conv2d(1, 1, 3, data_format="NHWC")


def test_conv2d_small_map_lowering_keeps_the_same_padding():
    from autopar.perf.small_conv import install

    torch.manual_seed(0)
    net = nn.SequentialCell(nn.Conv2d(4, 6, 3, stride=2), nn.Conv2d(6, 6, 3))
    x = torch.randn(2, 4, 3, 3)  # 2x2 then 2x2 output maps: both lowered to a matrix multiply
    expected = net(x)
    assert install(net) == 2
    assert torch.allclose(net(x), expected, atol=1e-5)


def test_batchnorm_momentum_is_mindspores_convention():
    bn = nn.BatchNorm2d(3)  # momentum=0.9: moving = 0.9 * moving + 0.1 * batch
    assert bn.ms_momentum == pytest.approx(0.9) and bn.momentum == pytest.approx(0.1) and bn.eps == 1e-5
    x = torch.randn(8, 3, 4, 4) * 2 + 5
    bn.train()
    bn(x)
    assert torch.allclose(bn.running_mean, 0.1 * x.mean(dim=(0, 2, 3)), atol=1e-5)
    tuned = nn.BatchNorm2d(3, momentum=0.99, gamma_init="Uniform", beta_init=torch.full((3,), 0.5),
                           moving_var_init="zeros")
    assert tuned.momentum == pytest.approx(0.01) and tuned.weight.abs().max() <= 0.07
    assert torch.equal(tuned.bias, torch.full((3,), 0.5)) and float(tuned.running_var.abs().max()) == 0.0
    frozen = nn.BatchNorm2d(3, use_batch_statistics=False)
    frozen.train()
    assert torch.allclose(frozen(x), x / math.sqrt(1 + 1e-5), atol=1e-5)  # moving statistics 0 / 1, not updated
    assert float(frozen.running_mean.abs().max()) == 0.0
    assert isinstance(nn.BatchNorm1d(4), torch.nn.BatchNorm1d)


def test_pooling_pad_modes():
    x = torch.arange(25.0).reshape(1, 1, 5, 5) - 30  # all negative: -inf padding must never win the max
    same = nn.MaxPool2d(kernel_size=3, stride=2, pad_mode="same")
    assert same(x).shape == (1, 1, 3, 3)
    assert torch.equal(same(x), F.max_pool2d(F.pad(x, (1, 1, 1, 1), value=float("-inf")), 3, 2))
    assert nn.MaxPool2d(kernel_size=2, stride=2)(x).shape == (1, 1, 2, 2)  # default "valid"
    avg = nn.AvgPool2d(kernel_size=2, stride=2, pad_mode="same")
    ones = torch.ones(1, 1, 5, 5)
    assert avg(ones).shape == (1, 1, 3, 3) and torch.allclose(avg(ones), torch.ones(1, 1, 3, 3))  # padding not counted


def test_parameter_free_layers_and_containers():
    assert isinstance(nn.ReLU(), torch.nn.ReLU) and isinstance(nn.Flatten(), torch.nn.Flatten)
    assert nn.Flatten()(torch.ones(2, 3, 4)).shape == (2, 12)
    assert nn.Dropout(keep_prob=0.8).p == pytest.approx(0.2) and nn.Dropout(p=0.3).p == pytest.approx(0.3)
    with pytest.raises(ConfigError, match="drop probability"):
        nn.Dropout(keep_prob=0.0)
    drop = nn.Dropout(keep_prob=0.5)
    drop.set_train(False)
    x = torch.randn(4, 4)
    assert torch.equal(drop(x), x)
    assert nn.GELU().approximate == "tanh" and nn.GELU(False).approximate == "none"
    dense = nn.Dense(4, 4)
    for seq in (nn.SequentialCell(dense, nn.ReLU()), nn.SequentialCell([dense, nn.ReLU()]),
                nn.SequentialCell(OrderedDict(fc=dense, act=nn.ReLU()))):
        assert torch.equal(seq(x), torch.relu(dense(x)))
    cells = nn.CellList([nn.ReLU()])
    cells.append(nn.Tanh())
    assert len(cells) == 2 and isinstance(cells, nn.Cell)
    assert isinstance(nn.get_activation("relu"), nn.ReLU)


def test_losses_take_mindspore_labels():
    logits, labels = torch.randn(6, 4), torch.tensor([0, 1, 3, 2, 1, 0], dtype=torch.int32)
    assert torch.allclose(nn.CrossEntropyLoss()(logits, labels), F.cross_entropy(logits, labels.long()))
    sce = nn.SoftmaxCrossEntropyWithLogits(sparse=True)  # MindSpore's default reduction='none': one per sample
    assert sce(logits, labels).shape == (6,)
    target = torch.randn(6, 4)
    assert torch.allclose(nn.MSELoss()(logits, target), F.mse_loss(logits, target))
    assert nn.MAELoss is nn.L1Loss and torch.allclose(nn.L1Loss()(logits, target), F.l1_loss(logits, target))
    assert nn.SmoothL1Loss()(logits, target).shape == (6, 4)


def test_a_per_sample_loss_trains_with_a_sensitivity_of_ones():
    torch.manual_seed(0)
    net, ref = nn.Dense(4, 3), nn.Dense(4, 3)
    ref.load_state_dict(net.state_dict())
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 1, 0])
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True)),
                               nn.SGD(net.trainable_params(), 0.1))
    assert step(x, y).shape == (5,)
    F.cross_entropy(ref(x), y, reduction="sum").backward()  # ones sensitivity = the gradient of the sum
    with torch.no_grad():
        expected = ref.weight - 0.1 * ref.weight.grad
    assert torch.allclose(net.weight, expected, atol=1e-6)
