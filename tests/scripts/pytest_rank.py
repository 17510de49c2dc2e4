"""A rank as MindSpore's r1.x/r2.1 run scripts start it: ``pytest -s -v pytest_rank.py`` (``init()`` at import, so
inside pytest's collection; the training in a test function). FAIL_RANK=r fails that rank's test."""
import os

import torch

from autopar.communication import get_group_size, get_rank, init

init()


def test_train():
    t = torch.ones(1) * (get_rank() + 1)
    torch.distributed.all_reduce(t)
    assert float(t) == sum(range(1, get_group_size() + 1))
    assert os.environ.get("FAIL_RANK") != str(get_rank())
