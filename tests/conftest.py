"""Shared fixtures. ``procs`` starts real processes (see :mod:`procutil`) and kills whatever is left at teardown.

Every test that uses ``procs`` is marked ``procs``: ``pytest -m "not procs"`` is the fast tier (single-process tests
only, under two minutes); the default run is the whole suite."""
import pytest

from procutil import Procs


def pytest_configure(config):
    config.addinivalue_line("markers", "procs: starts real processes (launched jobs); the fast tier deselects it")


def pytest_collection_modifyitems(items):
    for item in items:
        if "procs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.procs)


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.kill_all()
