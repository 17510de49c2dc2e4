"""Model and data shared by the checkpoint worker (ckpt_job.py) and the tests that check its files."""
import numpy as np
import torch

rng = np.random.default_rng(0)
X = rng.standard_normal((96, 16)).astype(np.float32)
Y = rng.integers(0, 6, 96).astype(np.int32)
PROBE = torch.tensor(rng.standard_normal((8, 16)).astype(np.float32))


class MLP(torch.nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.act = torch.nn.ReLU()
        self.drop = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        self.fc2 = torch.nn.Linear(32, 6)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))
