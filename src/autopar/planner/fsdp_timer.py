"""What ZeRO (data parallel on FSDP2) adds to a step, measured on the job's own devices at its own group sizes.

Why: built from the calibrated collectives, ZeRO was predicted 15-43 % fast (``bench/auto_vs_hand.py``). On a CPU
host FSDP2's copies into and out of its flat buffers, its hooks and its gloo gathers cost 1.5-2.5x what the
collectives measured alone, and the share grows with the group (a 4 MiB group's per-byte cost predicted a 64 MiB
group's 40 % low). So, as the operators are (:mod:`autopar.planner.op_timer`), each FSDP2 group size of the job --
rounded to a power of two -- is measured once: one ``Linear`` of that many bytes stepped sharded and unsharded at
both levels, the difference less the optimizer's (1/n of the parameters, on DTensors). Kept in the operator cache
per host, thread count and world size. Every rank measures at once (FSDP2 is collective), after the ranks agree
that one of them lacks the size (:meth:`OpTimer.agreed`).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

LEVELS = (("level1", False), ("level3", True))  # (level, reshard after forward)
SMALLEST = 1 << 12


def bucket(nbytes: float) -> int:
    """The power of two a group of ``nbytes`` is measured at."""
    return 1 << max(12, round(math.log2(max(nbytes, SMALLEST))))


def fsdp_seconds(machine, groups: list[float]) -> dict[str, float] | None:
    """Seconds ZeRO adds to a step of FSDP2 groups of ``groups`` bytes, per level ("level1", "level2", "level3"),
    each group's size measured (scaled by its bytes from the power of two it was measured at); None outside a job
    (no operator timer) or where FSDP2 would not step (its collectives are costed instead)."""
    timer = getattr(machine, "op_timer", None)
    if timer is None or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    level1 = level3 = 0.0
    for g in groups:
        size = bucket(g)
        measured = timer.agreed(f"fsdp {size}", lambda size=size: _measure(machine, timer, size))
        if measured is None:
            return None
        level1 += measured[0] * g / size
        # level 3 does all level 1 does and gathers again: never cheaper (two noisy measurements can say so)
        level3 += max(measured) * g / size
    return {"level1": level1, "level2": level1, "level3": level3}  # level 2 keeps the gathered weights as level 1


def _measure(machine, timer, size: int) -> tuple[float, float]:
    from torch.distributed.fsdp import fully_shard

    from autopar.comm.topology import dp_mesh
    from autopar.planner.machine import _timed

    n, device = dist.get_world_size(), timer.device
    width = max(n, int(math.sqrt(size / 4)) // n * n)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        plain = torch.nn.Sequential(torch.nn.Linear(width, width, bias=False)).to(device)
        x = torch.randn(8, width, device=device)
        nbytes = float(width * width * 4)

        def stepper(net):
            opt = torch.optim.SGD(net.parameters(), lr=1e-6, momentum=0.9)

            def step():
                net(x).square().mean().backward()
                opt.step()
                opt.zero_grad()

            step()  # warm-up (FSDP2's lazy initialisation, the optimizer state)
            return step

        base = _timed(stepper(plain))
        optimizer = nbytes * (1 / n / machine.optimizer_rate("layout") - 1 / machine.optimizer_rate("fused"))
        out = []
        for _, reshard in LEVELS:
            net = copy.deepcopy(plain)
            fully_shard(net[0], mesh=dp_mesh(), reshard_after_forward=reshard)
            fully_shard(net, mesh=dp_mesh(), reshard_after_forward=reshard)
            out.append(max(0.0, _timed(stepper(net)) - base - optimizer) * size / nbytes)
    return out[0], out[1]
