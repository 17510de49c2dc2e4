"""Fixtures of the dataset tests: small real CIFAR-10 binary files on disk, and a clean global config."""
from __future__ import annotations

import pytest

from autopar.dataset import config
from autopar.dataset.synth import write_synthetic_cifar10


@pytest.fixture(scope="session")
def cifar_small(tmp_path_factory):
    """``<tmp>/cifar-10-batches-bin`` with 64 records per file (320 train, 64 test); returns the parent dir."""
    root = tmp_path_factory.mktemp("cifar_small")
    write_synthetic_cifar10(root, records_per_file=64, seed=3)
    return root


@pytest.fixture(autouse=True)
def _default_config():
    config.set_seed(0)
    config.set_prefetch_size(2)
    yield
    config.set_seed(0)
    config.set_prefetch_size(2)

