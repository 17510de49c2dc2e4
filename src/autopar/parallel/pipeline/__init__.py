"""Pipeline parallelism on ``torch.distributed.pipelining``: MindSpore's ``pipeline_stages`` + ``nn.PipelineCell`` and
the PyTorch door's ``PipelineParallel``."""
from autopar.parallel.pipeline.runner import PipelineParallel, pipeline_of  # noqa: F401
from autopar.parallel.pipeline.split import (  # noqa: F401
    segments_of,
    split_points_from_stages,
    stage_of_modules,
)
