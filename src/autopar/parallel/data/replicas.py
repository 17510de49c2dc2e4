"""DATA_PARALLEL: bucketed gradient sums overlapped with the backward pass.

Ranks that all run on one CPU host sum through shared memory (:mod:`autopar.parallel.grads.buckets`); everywhere else
-- GPUs (NCCL), several hosts, GRAPH_MODE, parameters that are not float32, ``AUTOPAR_SHARED_MEMORY=0`` -- torch's
DistributedDataParallel does, on gloo or NCCL.

MindSpore semantics on top of DDP:

- ``gradients_mean=False`` (MindSpore's default) *sums* the gradients over ranks: a communication hook all-reduces
  each bucket without DDP's division by the world size. ``True`` averages (DDP's built-in C++ path).
- ``parameter_broadcast=True`` copies rank 0's initial parameters and buffers to every rank (DDP's ``init_sync``).
  With ``False`` nothing is copied, as in MindSpore; since differently initialised replicas silently train a
  different model on each rank, the ranks compare a fingerprint of their parameters and rank 0 warns if they differ.
- BatchNorm statistics stay per rank (MindSpore does not synchronise them): ``broadcast_buffers=False`` also saves a
  collective before every forward that DDP would otherwise issue.
- Gradient accumulation runs the first k-1 micro-batches under ``no_sync()``: no communication until the last.
"""
from __future__ import annotations

import hashlib
import inspect
import sys
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

DEFAULT_BUCKET_MB = 25.0
# torch 2.14 renamed DDP's broadcast_buffers to forward_sync_buffers (buffers still sync at init with init_sync).
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


def _sum_hook(process_group, bucket):
    """All-reduce a bucket as a sum (DDP's default hook divides by the world size first)."""
    group = process_group if process_group is not None else dist.group.WORLD
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def parameter_fingerprint(module: torch.nn.Module, ignore: set[str] | None = None) -> torch.Tensor:
    """A cheap summary of the parameters (float64 sums of each tensor and of its squares)."""
    ignore = ignore or set()
    with torch.no_grad():
        sums = [torch.stack([p.double().sum(), p.double().square().sum()])
                for n, p in module.named_parameters() if n not in ignore]
    return torch.cat(sums).cpu() if sums else torch.zeros(2, dtype=torch.float64)


def replicas_agree(module: torch.nn.Module, ignore: set[str] | None = None) -> bool:
    fp = parameter_fingerprint(module, ignore)
    gathered = [torch.empty_like(fp) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, fp)
    return all(torch.allclose(g, gathered[0], rtol=1e-6, atol=1e-6) for g in gathered)


def warn_if_replicas_differ(module: torch.nn.Module, ignore: set[str] | None = None) -> None:
    """Collective. Rank 0 warns when the replicas start from different parameters (parameter_broadcast=False)."""
    if not replicas_agree(module, ignore) and dist.get_rank() == 0:
        warnings.warn(
            "autopar: parameters differ across ranks at the start of DATA_PARALLEL training and "
            "parameter_broadcast=False; each rank will train a different model. Set "
            "parameter_broadcast=True or seed every rank identically (autopar.set_seed).",
            stacklevel=4,
        )
        sys.stderr.flush()


def wrap_data_parallel(
    module: torch.nn.Module,
    *,
    gradients_mean: bool,
    parameter_broadcast: bool,
    device: torch.device,
    bucket_cap_mb: float = DEFAULT_BUCKET_MB,
    gradient_as_bucket_view: bool = True,
    ignore: set[str] | None = None,
    shared_memory: bool = False,
):
    """The network wrapped for DATA_PARALLEL: call it as the network; ``.no_sync()`` for accumulation.

    ``shared_memory``: sum through shared memory when every rank runs on this host on the CPU (a collective)."""
    if not dist.is_initialized():
        from autopar.errors import ConfigError

        raise ConfigError("DATA_PARALLEL needs the cluster: call autopar.communication.init() first")
    if not parameter_broadcast and dist.get_world_size() > 1:
        warn_if_replicas_differ(module, ignore)
    if device.type == "cpu":  # every rank asks (a collective), willing or not: they all decide together
        reducer = _host_reducer(module, gradients_mean, parameter_broadcast, bucket_cap_mb, ignore or set(),
                                willing=shared_memory)
        if reducer is not None:
            return reducer
    if ignore:  # hybrid parallel: layerwise_parallel slices are neither synchronised nor all-reduced
        # DDP builds its reducer's names as f"{module_name}.{param_name}": a parameter of the root module itself is
        # ".w", not "w" -- without that spelling too it would be all-reduced (averaging different slices), silently
        root_level = {"." + name for name in ignore if "." not in name}
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, sorted(set(ignore) | root_level))
    ddp = DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        **_NO_FORWARD_BUFFER_SYNC,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
        init_sync=parameter_broadcast,
    )
    if not gradients_mean:
        ddp.register_comm_hook(None, _sum_hook)
    return ddp


def _host_reducer(module, gradients_mean: bool, parameter_broadcast: bool, bucket_cap_mb: float, ignore: set[str],
                  willing: bool = True):
    """The shared-memory reducer when every rank is on this host and every gradient is float32, else None.

    Collective: every rank takes the same branch (the decision rests on what all ranks see)."""
    from autopar.comm.host_memory import HostGroup
    from autopar.parallel.grads.buckets import HostReducer

    world = dist.get_world_size()
    params = [p for n, p in module.named_parameters() if p.requires_grad and n not in ignore]
    if world < 2:
        return None
    scale = 1.0 / world if gradients_mean else 1.0
    bucket_numel = max(1, int(bucket_cap_mb * 2**20) // 4)
    known = module.__dict__.get("_autopar_host_reducer")
    if known is not None and known.scale == scale and len(known.params) == len(params) \
            and all(a is b for a, b in zip(known.params, params)):
        return known  # prepared again (another Model on the same network): the same segment, no second one
    willing = willing and bool(params) and all(p.dtype == torch.float32 and p.layout == torch.strided for p in params)
    signature = f"{[tuple(p.shape) for p in params]}/{bucket_numel}"  # the ranks must bucket alike
    host = HostGroup.create(sum(p.numel() for p in params), willing=willing,
                            signature=hashlib.sha1(signature.encode()).hexdigest())
    if host is None:
        return None
    if parameter_broadcast:  # DDP's init_sync: rank 0's parameters and buffers on every rank
        with torch.no_grad():
            for name, t in [*module.named_parameters(), *module.named_buffers()]:
                if name not in ignore:
                    dist.broadcast(t, 0)
    reducer = HostReducer(module, params, host, scale=scale, bucket_numel=bucket_numel)
    module.__dict__["_autopar_host_reducer"] = reducer
    return reducer
