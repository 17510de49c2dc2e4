"""``autopar.dataset.transforms``: generic transforms (MindSpore ``mindspore.dataset.transforms``).

The sub-modules ``c_transforms`` / ``py_transforms`` and ``vision.c_transforms`` exist only so that older
MindSpore import paths keep working after replacing ``mindspore`` by ``autopar``.
"""
from autopar.dataset.transforms.ops import Compose, Transform, TypeCast

__all__ = ["Compose", "Transform", "TypeCast"]
