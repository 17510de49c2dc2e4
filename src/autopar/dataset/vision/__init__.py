"""``autopar.dataset.vision``: image transforms (MindSpore ``mindspore.dataset.vision``).

``c_transforms`` / ``py_transforms`` re-export the same classes so MindSpore 1.x import paths keep working.
"""
from autopar.dataset.vision.ops import (
    HWC2CHW,
    Border,
    CenterCrop,
    Inter,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    RandomVerticalFlip,
    Rescale,
    Resize,
)

__all__ = [
    "Border", "CenterCrop", "HWC2CHW", "Inter", "Normalize", "RandomCrop", "RandomHorizontalFlip",
    "RandomVerticalFlip", "Rescale", "Resize",
]
