"""Alias of :mod:`autopar.dataset.vision` for the MindSpore 1.x path ``dataset.vision.py_transforms``."""
from autopar.dataset.vision.ops import *  # noqa: F401,F403
from autopar.dataset.vision.ops import __all__  # noqa: F401
