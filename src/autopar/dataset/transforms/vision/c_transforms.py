"""Alias for the MindSpore r0.2 path ``dataset.transforms.vision.c_transforms``."""
from autopar.dataset.vision import *  # noqa: F401,F403
from autopar.dataset.vision import __all__  # noqa: F401
