"""``mindspore.parallel.nn`` (MindSpore 2.6+): the parallel training wrappers under their newer names -- the same
cells as ``autopar.nn``'s (one implementation)."""
from autopar.nn.wrappers import GradAccumulationCell as GradAccumulation  # noqa: F401
from autopar.nn.wrappers import PipelineCell as Pipeline  # noqa: F401
from autopar.nn.wrappers import PipelineGradReducer  # noqa: F401
