"""examples/resnet.py (the CPU tutorial's network in MindSpore's vocabulary) is autopar.models.resnet50: the same
parameters, names and shapes, the same outputs from the same weights, MindSpore's initialisation."""
import sys

import torch

import autopar.models as models
from autopar import nn
from procutil import ROOT

sys.path.insert(0, str(ROOT / "examples"))
from resnet import resnet50  # noqa: E402 - the import the tutorial's script writes


def test_example_resnet_equals_the_models_resnet50():
    torch.manual_seed(0)
    ours, ref = resnet50(32, 10), models.resnet50(32, 10)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters()) == 23528522
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    ours.load_state_dict(ref.state_dict())
    ours.set_train(False)
    ref.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(ours(x), ref(x), atol=1e-4)
    assert all(isinstance(m, nn.Conv2d) and m.pad_mode == "same" for m in ours.modules()
               if isinstance(m, torch.nn.Conv2d))
    bns = [m for m in ours.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bns) == 53 and all(abs(m.ms_momentum - 0.99) < 1e-9 for m in bns)
    fresh = resnet50(32, 10)
    assert float(fresh.bn1.weight.detach().abs().max()) <= 0.07 and float(fresh.bn1.running_var.min()) == 1.0
