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
import statistics

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


# -- the network itself ---------------------------------------------------------------------------------------------
def zero_step_seconds(machine, key: str, root: torch.nn.Module, inputs: tuple, kwargs: dict,
                      device_num: int) -> dict[str, float] | None:
    """Seconds of one training step of ``root`` (the network with its loss) under ZeRO, per level, measured whole
    on the job's devices: a deep copy sharded on FSDP2 as :func:`autopar.parallel.zero.fsdp.shard_optimizer`
    shards it (every module owning parameters a group, the network the rest), stepped -- forward, backward, the
    optimizer on its slices -- on this rank's share of the batch, every rank at once, the slowest rank's median
    step. None outside a job or where the copy cannot step (the groups' sizes are measured instead).

    Why: summed from its groups measured one at a time, ZeRO-3 of the wide MLP was predicted 1.5-1.8x its step on
    4 ranks -- alone, a group exposes every gather that a network's groups overlap with each other's compute -- and
    ResNet-50's 107 groups 20-35 % fast. Used where ZeRO can be chosen: data parallel does not fit, or the
    context asks for the optimizer sharded."""
    timer = getattr(machine, "op_timer", None)
    if timer is None or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    measured = timer.agreed(key, lambda: _measure_network(timer, root, inputs, kwargs, device_num))
    if measured is None:
        return None
    # level 3 does all level 1 does and gathers again: never cheaper (two noisy measurements can say so)
    return {"level1": measured[0], "level2": measured[0], "level3": max(measured)}


def zero_groups(network: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules ZeRO gives an FSDP2 group of their own, outermost first: every module owning trainable
    parameters that no other module holds too (a tied embedding and output head stay with the network's group).
    One rule for the runtime (:func:`autopar.parallel.zero.fsdp.shard_optimizer`) and for its measurement here."""
    holders: dict[int, int] = {}
    for module in network.modules():
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    return [m for m in network.modules() if m is not network
            and any(p.requires_grad for p in m.parameters(recurse=False))
            and all(holders[id(p)] == 1 for p in m.parameters(recurse=False))]


def _settled(step, steps: int = 8, kept: int = 5) -> float:
    """Seconds of ``step`` once its heap has settled: one untimed step (it builds FSDP2's state and the momentum
    buffers; a copy that cannot step fails here), then ``steps`` more, each the slowest rank's, and the median of
    the last ``kept`` of them. Every rank takes the same steps (the times are agreed by a collective).

    Why: a fresh copy's steps get faster for several steps while the heap grows (page-faulted in once, kept after:
    :func:`autopar.perf.tuning.tune_allocator`), and not steadily -- the wide MLP's ZeRO-3 on 2 ranks stepped 1.48,
    2.33, 1.01, 1.42, 1.23, 1.15, 0.99, 0.99, 0.89 s, its ZeRO-1 0.86, 0.80, 0.70, 0.68, 0.64, 0.68, 0.64, 0.86,
    0.83 s, against 0.96 and 0.62 s in training. Stopping at the first two calm steps and taking the median of the
    next three put ZeRO-1 at 0.57-0.90 s in four runs (+61 % in bench/auto_vs_hand.py); the fastest steps are luck
    on 4 ranks sharing 2 cores (the fastest of five: ZeRO-3 -20 %; the median of the fastest three of eight: the
    transformer and Llama blocks' ZeRO -8 to -19 %). The median of the last five skips the growth and the outliers."""
    from autopar.planner.machine import _slowest

    step()
    times = []
    for _ in range(steps):
        dist.barrier()
        times.append(_slowest(step))
    return statistics.median(times[-kept:])


def training_step(timer, net: torch.nn.Module, opt: torch.optim.Optimizer, args: tuple, kwargs: dict):
    """One training step of a measured copy: forward, backward from the sum of its outputs, the optimizer."""
    from torch.utils._pytree import tree_flatten

    def step():
        result = net(*args, **kwargs)
        leaves = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        sum(t.float().sum() for t in leaves).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        timer._sync()

    return step


def _measure_network(timer, root: torch.nn.Module, inputs: tuple, kwargs: dict, device_num: int) -> tuple:
    from torch.distributed.fsdp import fully_shard

    from autopar.comm.topology import dp_mesh
    from autopar.planner.op_timer import rank_share

    args, kw = rank_share(timer, inputs, kwargs, device_num)
    out = []
    with torch.random.fork_rng(devices=[timer.device] if timer.device.type == "cuda" else []):
        for _, reshard in LEVELS:
            net = copy.deepcopy(root).train()
            for module in reversed(zero_groups(net)):  # innermost first, as fully_shard wants
                fully_shard(module, mesh=dp_mesh(), reshard_after_forward=reshard)
            fully_shard(net, mesh=dp_mesh(), reshard_after_forward=reshard)
            opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.0, momentum=0.9)
            out.append(_settled(training_step(timer, net, opt, args, kw)))
            del net, opt
    return out[0], out[1]
