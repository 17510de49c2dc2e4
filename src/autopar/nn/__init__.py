"""MindSpore-style ``nn``: ``Cell`` plus losses and optimizers (PyTorch modules underneath)."""
from autopar.nn.cell import Cell  # noqa: F401
