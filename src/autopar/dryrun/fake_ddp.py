"""torch's ``DistributedDataParallel`` in a dry run: a stand-in with its memory and its collectives.

DDP's C++ side reads parameter values (``_verify_param_shape_across_processes``), builds its gradient buckets and
times its steps with CUDA events -- none of which a fake tensor or a simulated GPU can serve. A torchrun-style
script wraps its model in DDP on its second line, so the dry run gives it a DDP that does what DDP does to memory
and to the process group, in Python:

- its gradient buckets: a flat copy of every trainable parameter's gradient, per device and dtype, in buckets of
  at most ``bucket_cap_mb`` (25 MB, the first 1 MB: ``dist._DEFAULT_FIRST_BUCKET_BYTES``), allocated when it is
  made -- none with ``gradient_as_bucket_view=True``, where the gradients are views of them;
- an all-reduce of every gradient as it is accumulated, unless in ``no_sync()``;
- ``.module``, ``no_sync()``, the ``module.``-prefixed state dict (an ``nn.Module`` holding it), and it is an
  instance of torch's class.

Communication hooks (``register_comm_hook``) are accepted and warned about: what they change (a compressed bucket)
is not simulated.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

_FIRST_BUCKET = 1024 * 1024  # dist._DEFAULT_FIRST_BUCKET_BYTES


class DryRunDDP(DistributedDataParallel):
    def __init__(self, module: torch.nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers=None, init_sync: bool = True, process_group=None, bucket_cap_mb=None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False, **kwargs) -> None:
        torch.nn.Module.__init__(self)
        self.module = module
        self.device_ids = device_ids
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        params = [p for p in module.parameters() if p.requires_grad]
        self._buckets = [] if gradient_as_bucket_view else _buckets(params, int((bucket_cap_mb or 25) * 1024 * 1024))
        self._hooks = [p.register_post_accumulate_grad_hook(self._reduce) for p in params]

    def _reduce(self, param: torch.Tensor) -> None:
        if self.require_backward_grad_sync and param.grad is not None:
            dist.all_reduce(param.grad, group=self.process_group)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def register_comm_hook(self, state, hook) -> None:
        warnings.warn("autopar: DDP's register_comm_hook is accepted in a dry run and not simulated (its buckets "
                      "are counted uncompressed)", stacklevel=2)

    def _set_static_graph(self) -> None:
        self.static_graph = True


def _buckets(params: list[torch.Tensor], cap: int) -> list[torch.Tensor]:
    """Flat buckets holding every gradient once, per (device, dtype), as DDP's reducer lays them out (in reverse
    order of the parameters, the first bucket 1 MB)."""
    groups: dict[tuple, list[int]] = {}
    for p in reversed(params):
        groups.setdefault((p.device, p.dtype), []).append(p.numel())
    out = []
    for (device, dtype), sizes in groups.items():
        limit, filled = _FIRST_BUCKET, 0
        item = torch.empty((), dtype=dtype).element_size()
        for n in sizes:
            if filled and (filled + n) * item > limit:
                out.append(torch.empty(filled, dtype=dtype, device=device))
                limit, filled = cap, 0
            filled += n
        if filled:
            out.append(torch.empty(filled, dtype=dtype, device=device))
    return out


def install() -> None:
    """Make ``torch.nn.parallel.DistributedDataParallel`` (and the name wherever torch exports it) the stand-in."""
    import torch.nn.parallel as parallel
    import torch.nn.parallel.distributed as distributed

    parallel.DistributedDataParallel = DryRunDDP
    distributed.DistributedDataParallel = DryRunDDP
