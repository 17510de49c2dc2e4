"""Replicas that start equal: what data parallelism needs before its first step.

``parameter_broadcast=True`` copies rank 0's initial parameters and buffers to every rank (DDP's ``init_sync``).
With ``False`` nothing is copied, as in MindSpore; since differently initialised replicas silently train a different
model on each rank, the ranks compare a fingerprint of their parameters and rank 0 warns if they differ. BatchNorm
statistics stay per rank afterwards (MindSpore does not synchronise them).
"""
from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist


def parameter_fingerprint(module: torch.nn.Module, ignore: set[str] | None = None) -> torch.Tensor:
    """A cheap summary of the parameters (float64 sums of each tensor and of its squares)."""
    ignore = ignore or set()
    with torch.no_grad():
        sums = [torch.stack([p.double().sum(), p.double().square().sum()])
                for n, p in module.named_parameters() if n not in ignore and not p.is_meta]
    return torch.cat(sums).cpu() if sums else torch.zeros(2, dtype=torch.float64)


def replicas_agree(module: torch.nn.Module, ignore: set[str] | None = None) -> bool:
    fp = parameter_fingerprint(module, ignore)
    gathered = [torch.empty_like(fp) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, fp)
    # (equal_nan: a meta-built network resumed from a checkpoint holds NaN until the checkpoint is read into it)
    return all(torch.allclose(g, gathered[0], rtol=1e-6, atol=1e-6, equal_nan=True) for g in gathered)


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


def equalize_replicas(network: torch.nn.Module, broadcast: bool, ignore: set[str] = frozenset()) -> None:
    """Collective. ``broadcast``: rank 0's parameters and buffers everywhere; otherwise rank 0 warns if the
    replicas differ. ``ignore``: names of parameters that are this rank's own slice (HYBRID's layerwise ones)."""
    if not dist.is_initialized() or dist.get_world_size() <= 1:
        return
    if not broadcast:
        warn_if_replicas_differ(network, set(ignore))
        return
    with torch.no_grad():
        for name, t in [*network.named_parameters(), *network.named_buffers()]:
            if name not in ignore and not t.is_meta:  # a meta one: every rank replays one record
                dist.broadcast(t.data, src=0)
