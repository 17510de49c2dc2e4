"""Data parallel's step measured whole, on the job's devices, for AUTO_PARALLEL's planner.

Why: the planner summed data parallel from its parts -- the operators timed one by one, the gradient sum calibrated
alone, a calibrated share of it hidden behind the backward -- and on a CPU host the parts do not add up. The sum runs
on a background thread beside the backward (:class:`~autopar.parallel.grads.transports.HostTransport`), the two
contend for the cores and the memory bandwidth, and the wide MLP's 256 MiB of gradients made its data-parallel step
on 4 ranks of this 2-core host 0.47-0.62 s where the parts said 0.39 (-21 to -37 %, ``bench/auto_vs_hand.py``).
ZeRO's steps were already measured whole (:func:`autopar.planner.fsdp_timer.zero_step_seconds`); this is the same
for the plan every other one is compared with. The planner does not import the runtime (the layers run one way): the
runtime hands it :data:`DATA_PARALLEL_STEP` (:func:`autopar.planner.api.make_plan`'s ``data_parallel_step``).
"""
from __future__ import annotations

import copy

import torch

from autopar import context as _context


class DataParallelStep:
    """What the planner is handed: ``key()`` names what changes the step besides the network (the levers, the
    bucket size; part of its cache key), a call measures it (:func:`data_parallel_step_seconds`)."""

    def key(self) -> str:
        from autopar.perf.tuning import current

        levers = current()
        return (f"buckets {_context.allreduce_bucket_mb()}/{levers.bucket_mb} shared {levers.shared_memory} "
                f"fused {levers.fused_optimizer} graph {_context.run_context().mode == _context.GRAPH_MODE}")

    def __call__(self, timer, root: torch.nn.Module, inputs: tuple, kwargs: dict, device_num: int):
        return data_parallel_step_seconds(timer, root, inputs, kwargs, device_num)


def data_parallel_step_seconds(timer, root: torch.nn.Module, inputs: tuple, kwargs: dict,
                               device_num: int) -> tuple[float, float]:
    """(step s, step s) of ``root`` (the network with its loss) under DATA_PARALLEL as this job would run it: a deep
    copy whose gradients the bucketed reducer sums (through shared memory on one CPU host, with the job's bucket
    size and levers), the optimizer on its fused kernel where torch has one, stepped on this rank's share of the
    batch, every rank at once; the slowest rank's median step once the heap has settled
    (:func:`~autopar.planner.fsdp_timer._settled`). Collective."""
    from autopar.parallel.grads.buckets import data_parallel_reducers
    from autopar.perf.tuning import channels_last_inputs, tune_network, tune_optimizer
    from autopar.planner.fsdp_timer import _settled, training_step
    from autopar.planner.op_timer import rank_share

    args, kw = rank_share(timer, inputs, kwargs, device_num)
    with torch.random.fork_rng(devices=[timer.device] if timer.device.type == "cuda" else []):
        net = copy.deepcopy(root).train()
        if tune_network(net):  # the network-side levers data parallel runs with (ResNet-50's small convolutions:
            args = tuple(channels_last_inputs(list(args)))  # measured 10-18 % slower without them)
        params = [p for p in net.parameters() if p.requires_grad]
        reducers = data_parallel_reducers(params, device_num, _context.auto_parallel_context())
        try:
            for reducer in reducers:
                reducer.watch(net)
            opt = torch.optim.SGD(params, lr=0.0, momentum=0.9)
            tune_optimizer(opt)  # as the runtime switches a data-parallel optimizer to its fused kernel
            seconds = _settled(training_step(timer, net, opt, args, kw))
        finally:
            for reducer in reducers:
                reducer.close()
                reducer.transport.close()
    return seconds, seconds


DATA_PARALLEL_STEP = DataParallelStep()
