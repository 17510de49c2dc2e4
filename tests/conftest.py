"""Shared fixtures. ``procs`` starts real processes (see :mod:`procutil`) and kills whatever is left at teardown."""
import pytest

from procutil import Procs


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.kill_all()
