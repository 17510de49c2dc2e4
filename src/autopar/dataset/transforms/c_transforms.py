"""Alias of :mod:`autopar.dataset.transforms` for the MindSpore 1.x path ``dataset.transforms.c_transforms``."""
from autopar.dataset.transforms.ops import Compose, TypeCast

__all__ = ["Compose", "TypeCast"]
