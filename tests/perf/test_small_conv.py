"""Tiny-map convolutions lowered to GEMMs (``autopar.perf.small_conv``) give torch's results and gradients."""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from autopar.models import resnet50
from autopar.models.resnet import SameConv2d
from autopar.perf import small_conv, tuning


def _grads(fn, x, w, b):
    x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    b = None if b is None else b.detach().requires_grad_(True)
    y = fn(x, w, b)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y, x.grad, w.grad, None if b is None else b.grad


CASES = [
    # (input shape, weight shape, stride, (top, bottom, left, right)): which path is taken
    ((4, 6, 1, 1), (5, 6, 3, 3), (1, 1), (1, 1, 1, 1)),  # 1 position: the centre tap only
    ((4, 6, 2, 2), (5, 6, 3, 3), (2, 2), (0, 1, 0, 1)),  # 1 position, asymmetric SAME padding of a stride-2 conv
    ((4, 6, 2, 2), (5, 6, 3, 3), (2, 2), (1, 1, 1, 1)),  # 1 position, symmetric padding
    ((4, 6, 2, 3), (5, 6, 1, 1), (2, 3), (0, 0, 0, 0)),  # 1 position, 1x1 kernel with stride
    ((4, 6, 2, 2), (5, 6, 3, 3), (1, 1), (1, 1, 1, 1)),  # 4 positions: unfold + GEMM
    ((4, 6, 4, 4), (5, 6, 3, 3), (2, 2), (0, 1, 0, 1)),  # 4 positions, asymmetric padding
    ((4, 6, 2, 2), (5, 6, 1, 1), (1, 1), (0, 0, 0, 0)),  # 4 positions, 1x1: one linear over the channels
    ((4, 6, 1, 3), (5, 6, 1, 3), (1, 1), (0, 0, 1, 1)),  # 3 positions, non-square
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("xs,ws,stride,pads", CASES)
def test_lowered_convolution_matches_torch_with_gradients(xs, ws, stride, pads, bias):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(xs, generator=g), torch.randn(ws, generator=g)
    b = torch.randn(ws[0], generator=g) if bias else None
    top, bottom, left, right = pads

    def reference(x, w, b):
        return F.conv2d(F.pad(x, (left, right, top, bottom)), w, b, stride)

    def lowered(x, w, b):
        y = small_conv.lowered_conv2d(x, w, b, stride, pads)
        assert y is not None, "this case should take the GEMM path"
        return y

    for got, want in zip(_grads(lowered, x, w, b), _grads(reference, x, w, b)):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_larger_maps_keep_torchs_kernel():
    x, w = torch.randn(2, 4, 4, 4), torch.randn(4, 4, 3, 3)
    assert small_conv.lowered_conv2d(x, w, None, (1, 1), (1, 1, 1, 1)) is None  # 16 positions
    assert small_conv.lowered_conv2d(x, w, None, (2, 2), (0, 1, 0, 1)) is not None  # 4 positions


def test_resnet50_on_32x32_trains_the_same_with_the_lowering():
    # float64: BatchNorm over a 1x1 map of 4 samples amplifies float32 rounding (of either kernel) to ~1 %
    torch.manual_seed(0)
    plain = resnet50(4, 10).double()
    lowered = copy.deepcopy(plain)
    assert small_conv.install(lowered) == sum(isinstance(m, torch.nn.Conv2d) for m in lowered.modules())
    assert small_conv.install(lowered) == 0  # idempotent
    x, y = torch.randn(4, 3, 32, 32, dtype=torch.float64), torch.randint(0, 10, (4,))
    losses = []
    for net in (plain, lowered):
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)
    for (name, a), b in zip(plain.named_parameters(), lowered.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-9 * a.grad.abs().max().item(), msg=name)
    assert list(plain.state_dict()) == list(lowered.state_dict())


def test_a_lowered_network_still_copies_and_pickles():
    net = torch.nn.Sequential(SameConv2d(3, 4, 3, 2), torch.nn.Conv2d(4, 2, 1))
    small_conv.install(net)
    x = torch.randn(2, 3, 2, 2)
    for clone in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        torch.testing.assert_close(clone(x), net(x))
        assert clone[0]._conv_forward.conv is clone[0]  # the copy runs its own weights, not the original's


def test_the_lever_is_a_default_on_cpu_and_can_be_switched_off(monkeypatch):
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 4, 3, groups=2))
    tuning.tune_network(net)
    assert isinstance(net[0].__dict__.get("_conv_forward"), small_conv.SmallOutputConv)
    assert "_conv_forward" not in net[1].__dict__  # grouped convolutions are not lowered
    monkeypatch.setenv("AUTOPAR_SMALL_CONV", "0")
    other = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
    tuning.tune_network(other)
    assert "_conv_forward" not in other[0].__dict__
