"""The ResNet-50 of MindSpore's distributed-training tutorials, as an ordinary ``torch.nn.Module``.

Mirrors ``docs/sample_code/resnet/resnet.py`` of the MindSpore ``docs`` repository (the network used by the
data/semi-auto/auto parallel tutorials; ``docs/sample_code/distributed_training_cpu/resnet.py`` is the same
network with the stem wrapped in a ``head`` cell). Three things are kept exactly as MindSpore has them, because
they are what makes a MindSpore checkpoint load here and give the same outputs:

* **Names.** Modules carry MindSpore's attribute names (``conv1``, ``bn1``, ``layer1.a.conv_down_sample``,
  ``layer3.f.bn3``, ``fc`` ...), so a checkpoint maps by simple renames (BN ``gamma/beta/moving_mean/
  moving_variance`` -> ``weight/bias/running_mean/running_var``; see :mod:`autopar.checkpoint.mindspore_names`).
* **Geometry.** The stride of a stage sits on the first 1x1 conv of its first block (and on its down-sample
  1x1 conv), not on the 3x3 conv as in torchvision; every conv and the max-pool use MindSpore's
  ``pad_mode="same"`` (TensorFlow SAME padding, extra row/column at the bottom/right when the total is odd).
* **Initialisation.** XavierUniform conv/dense weights, ``Uniform`` (U(-0.07, 0.07)) BN gamma and dense bias,
  zero beta / moving mean, unit moving variance, BN momentum 0.99 in MindSpore's convention.

The parameter count equals torchvision's ``resnet50`` (25,557,032 for 1000 classes): the two differ in stride
placement, padding and initialisation, not in shapes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import ConfigError

__all__ = [
    "ResNet",
    "ResNetStage",
    "ResidualBlock",
    "ResidualBlockWithDown",
    "SameConv2d",
    "SameMaxPool2d",
    "resnet50",
    "same_padding",
    "torch_momentum",
]

# MindSpore's ``Uniform`` initializer default: ``Uniform(scale=0.07)`` samples U(-scale, scale)
# (mindspore/python/mindspore/common/initializer.py, ``class Uniform: def __init__(self, scale=0.07)``).
MS_UNIFORM_SCALE = 0.07
# ``nn.BatchNorm2d(out_channels, momentum=0.99, eps=0.00001, ...)`` in bn_with_initialize(). MindSpore updates
# ``moving = momentum * moving + (1 - momentum) * batch``; torch uses ``(1 - m) * running + m * batch``, so
# MindSpore's 0.99 is torch's 0.01.
MS_BN_MOMENTUM = 0.99
BN_EPS = 1e-5


def torch_momentum(ms_momentum: float) -> float:
    """torch's BatchNorm momentum for MindSpore's: ``moving = m * moving + (1 - m) * batch`` is torch's
    ``(1 - m') * running + m' * batch`` with ``m' = 1 - m`` (``autopar.nn.BatchNorm2d`` uses it too)."""
    return 1.0 - ms_momentum


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """(before, after) padding of one spatial dim under MindSpore/TensorFlow ``pad_mode="same"``.

    The output is ``ceil(size / stride)``; the total padding ``max((out - 1) * stride + kernel - size, 0)`` is
    split with the odd extra element at the end (bottom / right), as MindSpore does.
    """
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


class SameConv2d(nn.Conv2d):
    """``nn.Conv2d`` with MindSpore's ``pad_mode="same"``: padding computed from the input size at run time.

    A real ``nn.Conv2d`` (``weight`` parameter, ``stride``/``kernel_size`` attributes) so tools that inspect
    convolutions keep working; it is built with ``padding=0`` and pads in :meth:`forward`.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0, bias=False)

    def padding_for(self, x: torch.Tensor) -> tuple[int, int, int, int]:
        """(top, bottom, left, right) zero padding of input ``x``."""
        top, bottom = same_padding(x.shape[-2], self.kernel_size[0], self.stride[0])
        left, right = same_padding(x.shape[-1], self.kernel_size[1], self.stride[1])
        return top, bottom, left, right

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # Overriding _conv_forward (not forward) keeps nn.Conv2d's contract: anything that calls the convolution
        # with other weights (autopar.shard's local shards) gets the SAME padding too.
        top, bottom, left, right = self.padding_for(x)
        if top == bottom and left == right:  # symmetric: let the convolution pad (no extra copy)
            return F.conv2d(x, weight, bias, self.stride, (top, left))
        return F.conv2d(F.pad(x, (left, right, top, bottom)), weight, bias, self.stride)


class SameMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` with ``pad_mode="same"``; pads with -inf so padding never wins the max (as MindSpore)."""

    def __init__(self, kernel_size: int, stride: int) -> None:
        super().__init__(kernel_size, stride=stride, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, bottom = same_padding(x.shape[-2], self.kernel_size, self.stride)
        left, right = same_padding(x.shape[-1], self.kernel_size, self.stride)
        if top or bottom or left or right:
            x = F.pad(x, (left, right, top, bottom), value=float("-inf"))
        return F.max_pool2d(x, self.kernel_size, self.stride)


def _conv(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> SameConv2d:
    """conv1x1 / conv3x3 / conv7x7 of the tutorial.

    Mirrors ``nn.Conv2d(in, out, kernel_size=k, stride=stride, padding=0, weight_init='XavierUniform',
    has_bias=False, pad_mode="same")``. XavierUniform is U(-b, b), b = sqrt(6 / (fan_in + fan_out)) with
    fan = channels * kh * kw -- the same fans ``torch.nn.init.xavier_uniform_`` uses.
    """
    conv = SameConv2d(in_channels, out_channels, kernel_size, stride)
    nn.init.xavier_uniform_(conv.weight)
    return conv


def _bn(channels: int) -> nn.BatchNorm2d:
    """bn_with_initialize / bn_with_initialize_last of the tutorial (the two are identical).

    Mirrors ``nn.BatchNorm2d(out_channels, momentum=0.99, eps=0.00001, gamma_init='Uniform', beta_init=beta,
    moving_mean_init=mean, moving_var_init=var)`` with beta = mean = zeros and var = ones
    (weight_variable_0 / weight_variable_1). Note gamma starts in U(-0.07, 0.07), not at 1.
    """
    bn = nn.BatchNorm2d(channels, eps=BN_EPS, momentum=torch_momentum(MS_BN_MOMENTUM))
    with torch.no_grad():
        bn.weight.uniform_(-MS_UNIFORM_SCALE, MS_UNIFORM_SCALE)  # gamma_init='Uniform'
        bn.bias.zero_()  # beta_init=weight_variable_0
        bn.running_mean.zero_()  # moving_mean_init=weight_variable_0
        bn.running_var.fill_(1.0)  # moving_var_init=weight_variable_1
    return bn


def _dense(in_features: int, out_features: int) -> nn.Linear:
    """fc_with_initialize: ``nn.Dense(in, out, weight_init='XavierUniform', bias_init='Uniform')``."""
    fc = nn.Linear(in_features, out_features)
    nn.init.xavier_uniform_(fc.weight)
    with torch.no_grad():
        fc.bias.uniform_(-MS_UNIFORM_SCALE, MS_UNIFORM_SCALE)
    return fc


class ResidualBlock(nn.Module):
    """Bottleneck block without down-sample branch (tutorial ``ResidualBlock``, identity shortcut).

    ``stride`` goes on ``conv1`` (the first 1x1 conv), exactly as the tutorial passes it.
    """

    expansion = 4

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        width = out_channels // self.expansion
        self.conv1 = _conv(in_channels, width, 1, stride)
        self.bn1 = _bn(width)
        self.conv2 = _conv(width, width, 3)
        self.bn2 = _bn(width)
        self.conv3 = _conv(width, out_channels, 1)
        self.bn3 = _bn(out_channels)
        self.relu = nn.ReLU()

    def _residual(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.bn3(self.conv3(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self._residual(x) + x)


class ResidualBlockWithDown(ResidualBlock):
    """Bottleneck block with a 1x1 conv + BN shortcut (tutorial ``ResidualBlockWithDown``).

    The shortcut conv carries the same stride as ``conv1``. Its parameters register after ``bn3``, as in the
    tutorial, so ``state_dict`` order follows MindSpore's parameter order.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1, down_sample: bool = True) -> None:
        super().__init__(in_channels, out_channels, stride)
        self.down_sample = down_sample  # stored but unused by the tutorial too: the branch is always applied
        self.conv_down_sample = _conv(in_channels, out_channels, 1, stride)
        self.bn_down_sample = _bn(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.bn_down_sample(self.conv_down_sample(x))
        return self.relu(self._residual(x) + identity)


class ResNetStage(nn.Sequential):
    """One stage (tutorial ``MakeLayer0..3``): blocks registered as ``a``, ``b``, ``c`` ... like MindSpore.

    The first block is a :class:`ResidualBlockWithDown`. ``stride`` goes to block ``a`` -- except that the
    tutorial's ``MakeLayer0`` (stage 1) hands it to block ``b`` instead; stage 1 always has stride 1, so both
    readings build the same network, and ``stride_on_second`` reproduces the tutorial literally.
    """

    def __init__(self, block: type[ResidualBlock], in_channels: int, out_channels: int, stride: int,
                 num_blocks: int, stride_on_second: bool = False) -> None:
        super().__init__()
        names = "abcdefghijklmnopqrstuvwxyz"
        for i in range(num_blocks):
            if i == 0:
                module = ResidualBlockWithDown(in_channels, out_channels, 1 if stride_on_second else stride)
            else:
                module = block(out_channels, out_channels, stride if (i == 1 and stride_on_second) else 1)
            self.add_module(names[i], module)


class ResNet(nn.Module):
    """Tutorial ``ResNet(block, num_classes=100, batch_size=32)``: stem, four stages, mean pool, dense.

    ``batch_size`` is kept (as ``self.batch_size``) only because the tutorial's signature has it; the network
    does not depend on it. Input is NCHW (``channels_last`` memory format works too).
    """

    def __init__(self, block: type[ResidualBlock] = ResidualBlock, num_classes: int = 100,
                 batch_size: int = 32, layers: tuple[int, int, int, int] = (3, 4, 6, 3)) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_classes = num_classes
        self.conv1 = _conv(3, 64, 7, 2)  # conv7x7(3, 64, stride=2, padding=0)
        self.bn1 = _bn(64)
        self.relu = nn.ReLU()
        self.maxpool = SameMaxPool2d(3, 2)  # nn.MaxPool2d(kernel_size=3, stride=2, pad_mode="same")
        self.layer1 = ResNetStage(block, 64, 256, 1, layers[0], stride_on_second=True)  # MakeLayer0
        self.layer2 = ResNetStage(block, 256, 512, 2, layers[1])  # MakeLayer1
        self.layer3 = ResNetStage(block, 512, 1024, 2, layers[2])  # MakeLayer2
        self.layer4 = ResNetStage(block, 1024, 2048, 2, layers[3])  # MakeLayer3
        self.fc = _dense(512 * block.expansion, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = x.mean(dim=(2, 3))  # ReduceMean(keep_dims=True) over (2, 3) then Squeeze(axis=(2, 3))
        return self.fc(x)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"resnet50: {name} must be a positive int, got {value!r}")
    return value


def resnet50(*args: int, num_classes: int | None = None, batch_size: int | None = None) -> ResNet:
    """Build the tutorial ResNet-50; accepts both the MindSpore and the PyTorch way of calling it.

    * ``resnet50(batch_size, num_classes)`` -- the tutorial's positional signature, e.g. ``resnet50(32, 10)``;
    * ``resnet50(num_classes=10)`` or ``resnet50(10)`` -- one positional argument means ``num_classes``
      (unless ``num_classes=`` is also given, then it is the batch size);
    * ``resnet50()`` -- 1000 classes, torchvision's default.

    ``batch_size`` does not change the network (the tutorial only stores it).
    """
    if len(args) > 2:
        raise TypeError(f"resnet50() takes at most 2 positional arguments (batch_size, num_classes), got {len(args)}")
    if len(args) == 2:
        if num_classes is not None or batch_size is not None:
            raise TypeError("resnet50(): batch_size/num_classes given both positionally and by keyword")
        batch_size, num_classes = args
    elif len(args) == 1:
        if num_classes is None:
            num_classes = args[0]
        elif batch_size is None:
            batch_size = args[0]
        else:
            raise TypeError("resnet50(): batch_size/num_classes given both positionally and by keyword")
    num_classes = _positive_int("num_classes", 1000 if num_classes is None else num_classes)
    batch_size = _positive_int("batch_size", 32 if batch_size is None else batch_size)
    return ResNet(ResidualBlock, num_classes, batch_size)

