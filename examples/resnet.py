"""ResNet-50 of the CPU distributed-training tutorial, written in MindSpore's vocabulary on autopar.

``resnet50_distributed_training.py`` imports it as the tutorial does (``from resnet import resnet50``). The network
is the tutorial's: a 7x7/2 stem and a 3x3/2 max-pool, four stages of 3, 4, 6 and 3 bottleneck blocks whose stride
sits on the first 1x1 convolution, every convolution and the pool with ``pad_mode="same"``, a mean over the map and
a dense classifier; XavierUniform weights, BatchNorm with MindSpore's momentum 0.99 and gamma drawn from
``Uniform`` (U(-0.07, 0.07)). Cells carry the tutorial's attribute names (``layer2.a.conv_down_sample`` ...), so
its parameters line up one to one with ``autopar.models.resnet50`` (the same network in plain torch) and with a
MindSpore checkpoint of the tutorial.
"""
import autopar as ms
import autopar.nn as nn
import autopar.ops as ops


def _conv(in_channels, out_channels, kernel_size, stride=1):
    return nn.Conv2d(in_channels, out_channels, kernel_size=kernel_size, stride=stride, pad_mode="same",
                     weight_init="XavierUniform", has_bias=False)


def _bn(channels):
    zeros = ms.Tensor([0.0] * channels, ms.float32)
    ones = ms.Tensor([1.0] * channels, ms.float32)
    return nn.BatchNorm2d(channels, momentum=0.99, eps=1e-5, gamma_init="Uniform", beta_init=zeros,
                          moving_mean_init=zeros, moving_var_init=ones)


class Bottleneck(nn.Cell):
    """1x1 (carrying the stride) -> 3x3 -> 1x1 to 4x the width, added to the input or to its 1x1 projection."""

    expansion = 4

    def __init__(self, in_channels, out_channels, stride=1, project=False):
        super().__init__()
        width = out_channels // self.expansion
        self.conv1, self.bn1 = _conv(in_channels, width, 1, stride), _bn(width)
        self.conv2, self.bn2 = _conv(width, width, 3), _bn(width)
        self.conv3, self.bn3 = _conv(width, out_channels, 1), _bn(out_channels)
        self.relu = ops.ReLU()
        self.add = ops.Add()
        self.project = project
        if project:
            self.conv_down_sample = _conv(in_channels, out_channels, 1, stride)
            self.bn_down_sample = _bn(out_channels)

    def construct(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        shortcut = self.bn_down_sample(self.conv_down_sample(x)) if self.project else x
        return self.relu(self.add(out, shortcut))


class Stage(nn.Cell):
    """``blocks`` bottlenecks named a, b, c ...; the first projects the input to the new width."""

    def __init__(self, in_channels, out_channels, stride, blocks):
        super().__init__()
        self.names = "abcdefghij"[:blocks]
        for i, name in enumerate(self.names):
            if i == 0:
                block = Bottleneck(in_channels, out_channels, stride, project=True)
            else:
                block = Bottleneck(out_channels, out_channels)
            setattr(self, name, block)

    def construct(self, x):
        for name in self.names:
            x = getattr(self, name)(x)
        return x


class ResNet(nn.Cell):
    def __init__(self, num_classes=100, batch_size=32, blocks=(3, 4, 6, 3)):
        super().__init__()
        self.batch_size = batch_size
        self.conv1, self.bn1 = _conv(3, 64, 7, 2), _bn(64)
        self.relu = ops.ReLU()
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, pad_mode="same")
        self.layer1 = Stage(64, 256, 1, blocks[0])
        self.layer2 = Stage(256, 512, 2, blocks[1])
        self.layer3 = Stage(512, 1024, 2, blocks[2])
        self.layer4 = Stage(1024, 2048, 2, blocks[3])
        self.mean = ops.ReduceMean(keep_dims=True)
        self.squeeze = ops.Squeeze(axis=(2, 3))
        self.fc = nn.Dense(2048, num_classes, weight_init="XavierUniform", bias_init="Uniform")

    def construct(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.squeeze(self.mean(x, (2, 3)))
        return self.fc(x)


def resnet50(batch_size, num_classes):
    """The tutorial's entry point: ``resnet50(batch_size, num_classes)``."""
    return ResNet(num_classes, batch_size)
