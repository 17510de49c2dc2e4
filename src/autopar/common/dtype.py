"""``import autopar.common.dtype as mstype`` (MindSpore path) -- the same objects as :mod:`autopar.dtype`."""
from autopar.dtype import *  # noqa: F401,F403
from autopar.dtype import __all__  # noqa: F401
