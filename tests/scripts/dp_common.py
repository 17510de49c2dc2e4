"""Model and data shared by the data-parallel equivalence worker and its single-process reference."""
import numpy as np
import torch


def make_data(n: int = 64):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 12)).astype(np.float32)
    y = rng.integers(0, 5, n).astype(np.int64)
    return x, y


def make_net() -> torch.nn.Module:
    net = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return net
