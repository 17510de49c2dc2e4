"""The tutorial ResNet-50 (autopar.models.resnet50): architecture, SAME padding, init, training, both doors."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import ConfigError
from autopar.models import ResidualBlock, ResidualBlockWithDown, ResNet, resnet50
from autopar.models.resnet import SameConv2d, SameMaxPool2d, same_padding

STAGES = [("layer1", 64, 256, 1, 3), ("layer2", 256, 512, 2, 4), ("layer3", 512, 1024, 2, 6),
          ("layer4", 1024, 2048, 2, 3)]


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    return resnet50(num_classes=10)


def _hand_count(num_classes: int) -> int:
    """Parameters of the tutorial net, from its architecture (not from the module)."""
    total = 3 * 64 * 7 * 7 + 2 * 64  # conv7x7 (no bias) + bn1 gamma/beta
    for _, cin, cout, _, blocks in STAGES:
        width = cout // 4

        def block(i, width=width, cout=cout):
            return i * width + 9 * width * width + width * cout + 2 * (width + width + cout)

        total += block(cin) + cin * cout + 2 * cout  # block a: bottleneck + conv_down_sample + bn_down_sample
        total += (blocks - 1) * block(cout)
    return total + 2048 * num_classes + num_classes  # Dense weight + bias


def test_parameter_count_matches_tutorial_net(net):
    count = sum(p.numel() for p in net.parameters())
    assert count == _hand_count(10) == 23_528_522
    # With 1000 classes it is 25,557,032 -- the same as torchvision's resnet50: the tutorial net differs from
    # torchvision in stride placement, SAME padding and initialisation, not in any parameter shape.
    assert _hand_count(1000) == 25_557_032
    buffers = sum(b.numel() for n, b in net.named_buffers() if not n.endswith("num_batches_tracked"))
    assert buffers == 2 * sum(m.num_features for m in net.modules() if isinstance(m, nn.BatchNorm2d))


def test_names_mirror_mindspore(net):
    names = list(net.state_dict())
    assert names[:3] == ["conv1.weight", "bn1.weight", "bn1.bias"]
    for expected in ["layer1.a.conv_down_sample.weight", "layer1.a.bn_down_sample.running_var",
                     "layer1.c.conv3.weight", "layer2.d.bn2.bias", "layer3.f.conv2.weight",
                     "layer4.c.bn3.running_mean", "fc.weight", "fc.bias"]:
        assert expected in names
    assert "layer1.d.conv1.weight" not in names and "layer3.g.conv1.weight" not in names
    for stage, _, _, _, blocks in STAGES:
        layer = getattr(net, stage)
        assert [n for n, _ in layer.named_children()] == list("abcdef"[:blocks])
        assert isinstance(layer.a, ResidualBlockWithDown)
        assert all(type(b) is ResidualBlock for b in list(layer.children())[1:])


@pytest.mark.parametrize("size, classes", [(32, 10), (64, 7)])
def test_output_shape(size, classes):
    torch.manual_seed(0)
    model = resnet50(num_classes=classes).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, size, size)).shape == (2, classes)


def test_same_padding_shapes(net):
    net = copy.deepcopy(net).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        stem = net.relu(net.bn1(net.conv1(x)))
        assert stem.shape[-2:] == (16, 16)
        pooled = net.maxpool(stem)
        assert pooled.shape[-2:] == (8, 8)
        shapes = []
        for stage, *_ in STAGES:
            pooled = getattr(net, stage)(pooled)
            shapes.append(tuple(pooled.shape[1:]))
    assert shapes == [(256, 8, 8), (512, 4, 4), (1024, 2, 2), (2048, 1, 1)]
    # Odd sizes round up (ceil(H / stride)), as MindSpore pad_mode="same".
    with torch.no_grad():
        assert net.conv1(torch.randn(1, 3, 33, 31)).shape[-2:] == (17, 16)
    assert same_padding(32, 7, 2) == (2, 3)  # total 5: the extra row goes to the bottom
    assert same_padding(16, 3, 2) == (0, 1)
    assert same_padding(32, 1, 2) == (0, 0)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
def test_same_conv_matches_torch_same_for_even_kernel():
    """torch's padding="same" (stride 1) also puts the odd extra pad at the end: an independent reference."""
    torch.manual_seed(0)
    ours = SameConv2d(2, 3, 4)
    ref = nn.Conv2d(2, 3, 4, padding="same", bias=False)
    ref.weight.data.copy_(ours.weight.data)
    x = torch.randn(1, 2, 9, 10)
    torch.testing.assert_close(ours(x), ref(x))


def test_same_conv_strided_pads_bottom_right():
    torch.manual_seed(0)
    conv = SameConv2d(1, 1, 7, stride=2)
    x = torch.randn(1, 1, 32, 32)
    expected = F.conv2d(F.pad(x, (2, 3, 2, 3)), conv.weight, stride=2)
    torch.testing.assert_close(conv(x), expected)


def test_same_maxpool_ignores_padding():
    x = -1.0 - torch.rand(1, 1, 16, 16)  # all negative: zero padding would leak 0 into the border
    out = SameMaxPool2d(3, 2)(x)
    assert out.shape[-2:] == (8, 8)
    assert (out < 0).all()
    torch.testing.assert_close(out[..., -1, -1], x[..., 14:, 14:].amax(dim=(-1, -2)))


def test_stride_on_first_1x1_conv(net):
    for stage, _, _, stride, _ in STAGES:
        layer = getattr(net, stage)
        assert layer.a.conv1.kernel_size == (1, 1) and layer.a.conv1.stride == (stride, stride)
        assert layer.a.conv_down_sample.stride == (stride, stride)
        assert layer.a.conv2.kernel_size == (3, 3) and layer.a.conv2.stride == (1, 1)
        assert layer.a.conv3.stride == (1, 1)
        for block in list(layer.children())[1:]:
            assert all(c.stride == (1, 1) for c in (block.conv1, block.conv2, block.conv3))
    assert net.conv1.kernel_size == (7, 7) and net.conv1.stride == (2, 2)
    assert all(m.bias is None for m in net.modules() if isinstance(m, nn.Conv2d))


def test_initialisation_follows_tutorial(net):
    for module in net.modules():
        if isinstance(module, nn.Conv2d):  # weight_init='XavierUniform'
            fan_in = module.in_channels * math.prod(module.kernel_size)
            fan_out = module.out_channels * math.prod(module.kernel_size)
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            assert module.weight.abs().max() <= bound
            if module.weight.numel() > 10_000:  # a uniform U(-b, b) has std b / sqrt(3)
                assert module.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
        elif isinstance(module, nn.BatchNorm2d):
            assert module.momentum == pytest.approx(0.01) and module.eps == 1e-5  # MindSpore momentum=0.99
            assert module.weight.abs().max() <= 0.07  # gamma_init='Uniform' (scale 0.07)
            assert (module.bias == 0).all() and (module.running_mean == 0).all()
            assert (module.running_var == 1).all()
    assert net.fc.weight.abs().max() <= math.sqrt(6.0 / (2048 + 10))
    assert net.fc.bias.abs().max() <= 0.07 and net.fc.bias.abs().max() > 0  # bias_init='Uniform'


def test_sgd_reduces_loss():
    torch.manual_seed(0)
    model = resnet50(num_classes=4).train()
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 4, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]


def test_both_doors_build_the_same_network():
    tutorial, torch_door, single = resnet50(32, 10), resnet50(num_classes=10), resnet50(10)
    shapes = lambda m: [(k, tuple(v.shape)) for k, v in m.state_dict().items()]  # noqa: E731
    assert shapes(tutorial) == shapes(torch_door) == shapes(single)
    assert tutorial.batch_size == 32 and tutorial.num_classes == 10 and single.fc.out_features == 10
    assert resnet50(16, num_classes=3).batch_size == 16
    assert resnet50().fc.out_features == 1000
    assert isinstance(tutorial, ResNet)
    with pytest.raises(ConfigError, match="num_classes"):
        resnet50(0)
    with pytest.raises(ConfigError, match="batch_size"):
        resnet50(-1, 10)
    with pytest.raises(TypeError):
        resnet50(1, 2, 3)
    with pytest.raises(TypeError):
        resnet50(32, 10, num_classes=10)


def test_channels_last_matches_contiguous(net):
    model = copy.deepcopy(net).eval()
    x = torch.randn(2, 3, 40, 36)
    with torch.no_grad():
        ref = model(x)
        model_cl = model.to(memory_format=torch.channels_last)
        out = model_cl(x.to(memory_format=torch.channels_last))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
