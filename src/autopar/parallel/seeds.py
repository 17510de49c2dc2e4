"""Every rank builds a meta-device network from the same random state, or its slices would come from different
networks: the check (and ``parameter_broadcast``'s remedy) the parallel modes and the pipeline stages share."""
from __future__ import annotations

import hashlib
import warnings

import torch

from autopar.comm import management as _comm
from autopar.errors import user_stacklevel


def same_draws_everywhere(network: torch.nn.Module, broadcast: bool) -> None:
    """Every rank computes the slices it keeps from its own record of the build: the ranks must have drawn alike
    (the same seed), or the slices would come from different networks. Collective. Where they did not:
    ``parameter_broadcast=True`` makes every rank draw as rank 0 did (rank 0's network, as broadcasting its
    parameters would); otherwise rank 0 warns, as data parallel does when replicas differ."""
    import torch.distributed as dist

    from autopar.common import deferred

    if not _comm.is_initialized() or _comm.get_group_size() < 2:
        return
    for rec in deferred.recordings_of(network):
        payload = rec.rng_payload()
        digest = torch.tensor([int.from_bytes(hashlib.sha1(payload.numpy().tobytes()).digest()[:7],
                                              "little"), payload.numel()], dtype=torch.int64)
        gathered = [torch.empty_like(digest) for _ in range(_comm.get_group_size())]
        dist.all_gather(gathered, digest)
        if all(torch.equal(g, gathered[0]) for g in gathered):
            continue
        if broadcast and all(g[1] == gathered[0][1] for g in gathered):
            dist.broadcast(payload, src=0)
            rec.adopt_rng_payload(payload)
        elif _comm.get_rank() == 0:
            warnings.warn("autopar: the ranks built the network from different random states (no common seed): "
                          "each rank's slices come from a different draw, not from one network. Seed every rank "
                          "alike (autopar.set_seed) or set parameter_broadcast=True", stacklevel=user_stacklevel())
