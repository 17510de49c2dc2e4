"""Shared fixtures. ``procs`` starts real processes (see :mod:`procutil`) and kills whatever is left at teardown.

Every test that uses ``procs`` (or a module fixture that launches jobs, ``_LAUNCHING``) is marked ``procs``; a
single-process test that computes for more than ~10 s is marked ``slow``. ``pytest -m "not procs and not slow"`` is
the fast tier (under two minutes); the default run is the whole suite."""
import pytest

from procutil import Procs


def pytest_configure(config):
    config.addinivalue_line("markers", "procs: starts real processes (launched jobs); the fast tier deselects it")
    config.addinivalue_line("markers", "slow: one process, but long (a 175B-parameter plan); the fast tier deselects it")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one; bench/gpu_check.sh runs them)")


# Module-scoped fixtures that launch jobs themselves (a function-scoped ``procs`` cannot serve a whole module).
_LAUNCHING = {"procs", "runs"}


def pytest_collection_modifyitems(items):
    for item in items:
        if _LAUNCHING & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.procs)


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.kill_all()
