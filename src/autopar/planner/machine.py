"""The machine the planner costs plans on: compute rates and an alpha-beta model of every collective.

Collective time for a tensor of S bytes on a group of n devices (ring algorithms):

    all_reduce      alpha + 2 (n-1)/n * S * beta
    all_gather      alpha +   (n-1)/n * S * beta      (S = the gathered tensor)
    reduce_scatter  alpha +   (n-1)/n * S * beta      (S = the input)
    all_to_all      alpha +   (n-1)/n * S * beta      (S = one rank's tensor)

``alpha`` (latency) and ``beta`` (seconds per byte) are fitted per collective by least squares from a short
micro-benchmark on the job's own backend and world size (every rank takes part, so it sees the real contention);
compute rates (FLOP/s per device for matmuls, convolutions and everything else) and the memory bandwidth (a
layer is costed as the slower of its arithmetic and streaming its operands) come from the same run. The
result is cached on disk per (backend, world size, host, threads per process), so calibration runs once.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.context import env_flag
from autopar.planner.cache import cache_dir, write_atomic

RING = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


@dataclass
class MachineModel:
    device_num: int
    flops: dict = field(default_factory=lambda: {"matmul": 2.0e10, "conv": 2.0e10, "other": 2.0e9})
    collectives: dict = field(default_factory=lambda: {k: (1e-4, 1e-9) for k in RING})  # (alpha s, beta s/byte)
    backend: str = "gloo"
    source: str = "default constants (not calibrated)"
    memory_bandwidth: float = 1.0e10  # bytes/s one device streams (weights of a small-batch layer are memory-bound)
    memory_per_device: float | None = None  # bytes available to one process
    # bytes of parameters one optimizer step (SGD with momentum) updates per second: "fused" is data parallel's
    # fused kernel on plain tensors; "layout" the per-parameter loop on DTensor parameters (the layout modes),
    # which the fused kernels do not take. None: derived from the memory bandwidth (5 and 10 passes).
    optimizer_rates: dict | None = None
    # what torch.distributed.pipelining costs per micro-batch and stage beyond the compute and the transfers (its
    # Python schedule, the send/recv posts and waits, the stage's autograd call): measured on this 2-core machine
    # over gloo with stages of four 8x8 layers -- 1.86 ms per slot at 8 micro-batches, 1.88 at 32
    pipeline_slot_seconds: float = 1.9e-3
    # what one operator on DTensors costs beyond its arithmetic (sharding propagation's cached lookup, the wrapping
    # and unwrapping of local tensors): a layout pays it for every operator of forward and backward, data parallel
    # (plain tensors) does not. None: not measured (0).
    dispatch_seconds: float | None = None
    # how much of a collective hides behind compute running at the same time: 1 all of it (NCCL beside the
    # kernels), 0 none (gloo's threads take the very cores the compute runs on). None: not measured (1).
    overlap: float | None = None
    # ranks sharing the cores of a CPU host (one thread each): how much longer their compute takes than its CPU time
    # times the ranks per core -- at every collective they wait for each other, and a core can idle while the rank
    # due on it waits. None: not measured (1).
    turn_taking: float | None = None

    def zero_exposed(self, level: str, gather: float, scatter: float, forward: float, backward: float) -> float:
        """The part of ZeRO's collectives the passes do not hide: the weights gathered for the forward (level 3:
        again for the backward) and the gradients reduce-scattered, each beside the pass it serves."""
        if level == "level3":
            return (gather - self.hidden(gather, forward)
                    + gather + scatter - self.hidden(gather + scatter, backward))
        return gather - self.hidden(gather, forward) + scatter - self.hidden(scatter, backward)

    def hidden(self, comm: float, compute: float) -> float:
        """The part of ``comm`` seconds of collectives that ``compute`` seconds running beside it hide."""
        share = 1.0 if self.overlap is None else min(1.0, max(0.0, self.overlap))
        return share * min(comm, compute)

    def optimizer_rate(self, kind: str) -> float:
        if self.optimizer_rates and kind in self.optimizer_rates:
            return float(self.optimizer_rates[kind])
        # SGD with momentum reads parameter, gradient and momentum and writes two of them; a scale reads and writes one
        return self.memory_bandwidth / {"fused": 5.0, "scale": 2.0}.get(kind, 10.0)

    def collective(self, kind: str, nbytes: float, n: int) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        alpha, beta = self.collectives[kind]
        return alpha + RING.get(kind, RING["all_reduce"])(n) * nbytes * beta

    def compute(self, kind: str, flops: float, moved_bytes: float = 0.0) -> float:
        """Roofline: the slower of doing the arithmetic and streaming the operands through memory."""
        rate = self.flops.get(kind) or self.flops["matmul" if kind == "attention" else "other"]
        return max(flops / rate, moved_bytes / self.memory_bandwidth)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "MachineModel":
        d = json.loads(text)
        d["collectives"] = {k: tuple(v) for k, v in d["collectives"].items()}
        known = {f.name for f in fields(cls)}  # a calibration kept by an earlier version: its retired terms dropped
        return cls(**{k: v for k, v in d.items() if k in known})


# in the calibration's file name: a calibration an earlier version measured differently is measured again
# (2: DTensor's dispatch probed on a chain of real operators, not on ``x + x``)
CALIBRATION_VERSION = 2


def cache_path(backend: str, world: int, threads: int | None = None) -> Path:
    """Where the calibration of (backend, world size, this host, threads per process) is kept."""
    base = cache_dir()
    threads = threads or torch.get_num_threads()
    return base / (f"machine-{backend}-n{world}-{socket.gethostname()}-c{os.cpu_count()}-t{threads}"
                   f"-v{CALIBRATION_VERSION}.json")


def _slowest(fn) -> float:
    """Seconds of one call of ``fn`` on the slowest rank (a collective ends when its last member does): one
    number on every rank."""
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _timed(fn, repeats: int = 3) -> float:
    """Median over repeats, every rank starting each together, of the slowest rank's time."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        times.append(_slowest(fn))
    return statistics.median(times)


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares t = alpha + x * beta (x = ring-weighted bytes), clamped to non-negative values."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(t for _, t in points) / n
    var = sum((x - mx) ** 2 for x, _ in points) or 1.0
    beta = max(sum((x - mx) * (t - my) for x, t in points) / var, 1e-13)
    alpha = max(my - beta * mx, 1e-6)
    return alpha, beta


def _collective_fn(kind: str, nbytes: int, n: int, device):
    elems = max(nbytes // 4, n)
    elems -= elems % n
    x = torch.ones(elems, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x)
    from autopar.comm.functional import _all_gather_single, _reduce_scatter_single

    if kind == "all_gather":
        local = torch.ones(elems // n, device=device)
        return lambda: _all_gather_single(x, local)
    if kind == "reduce_scatter":
        out = torch.empty(elems // n, device=device)
        return lambda: _reduce_scatter_single(out, x)
    out = torch.empty_like(x)
    return lambda: dist.all_to_all_single(out, x)


def _rate(fn, flops: float, seconds: float = 0.25) -> float:
    fn()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        count += 1
    elapsed = torch.tensor([(time.perf_counter() - start) / max(count, 1)], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return flops / float(elapsed)


def calibrate(sizes: tuple[int, ...] = (2**14, 2**18, 2**21, 2**23, 2**26)) -> MachineModel:
    """Measure this job's machine (collective: every rank must call it). A few seconds (side work: its optimizer
    steps are not the user's, :data:`autopar.context.side_work`)."""
    from autopar.context import side_work

    with side_work():
        return _calibrate(sizes)


def _calibrate(sizes: tuple[int, ...]) -> MachineModel:
    """The sizes reach 64 MiB: gradients of a few hundred MB are common, and a fit on messages up to 8 MiB predicted the
    268 MB all-reduce of bench/auto_vs_hand.py's MLP about 2x too fast on loopback gloo."""
    from autopar.comm import management

    n = dist.get_world_size()
    device = management.device()
    model = MachineModel(device_num=n, backend=management.backend(),
                         source=f"calibrated {time.strftime('%Y-%m-%d %H:%M')} on {socket.gethostname()}")
    if n > 1:
        for kind in RING:
            points = []
            for size in sizes:
                fn = _collective_fn(kind, size, n, device)
                fn()  # warm-up: connections, buffers
                points.append((RING[kind](n) * size, _timed(fn)))
            model.collectives[kind] = _fit(points)
    a = torch.randn(512, 512, device=device)
    model.flops["matmul"] = _rate(lambda: a @ a, 2 * 512**3)
    x = torch.randn(8, 64, 16, 16, device=device)
    w = torch.randn(64, 64, 3, 3, device=device)
    model.flops["conv"] = _rate(lambda: torch.nn.functional.conv2d(x, w, padding=1), 2 * 8 * 64 * 16 * 16 * 64 * 9)
    y = torch.randn(1 << 20, device=device)
    model.flops["other"] = _rate(lambda: torch.relu(y * 1.5 + 1.0), 3 * (1 << 20))
    big, dst = torch.randn(16 << 20, device=device), torch.empty(16 << 20, device=device)
    model.memory_bandwidth = _rate(lambda: dst.copy_(big), 2 * 4 * (16 << 20))  # read + write, in bytes/s
    model.optimizer_rates = _optimizer_rates(device)
    model.dispatch_seconds = _dispatch_seconds(device)
    if n > 1:
        model.overlap = _overlap(device)
        model.turn_taking = _turn_taking(device)
        host = _host_all_reduce(device, (2**21, 2**23, 2**25))
        if host is not None:
            model.collectives["host_all_reduce"] = host
    return model


def shared_memory_on() -> bool:
    """``AUTOPAR_SHARED_MEMORY`` (autopar.perf.tuning's lever): data parallel may sum through shared memory."""
    return env_flag("AUTOPAR_SHARED_MEMORY", True)


def _host_all_reduce(device, sizes) -> tuple[float, float] | None:
    """(alpha, beta) of data parallel's shared-memory sum among the ranks of one CPU host (what its bucketed
    reducer uses there instead of gloo, :mod:`autopar.comm.host_memory`), on the all-reduce's byte scale; None
    where it is not used (a GPU, ranks on several hosts, ``AUTOPAR_SHARED_MEMORY=0``).

    Sizes up to 32 MiB, the order of data parallel's 25 MiB buckets: the sum streams every rank's region, and
    regions that fit the last-level cache sum faster per byte -- on this 2-core host (32 MiB L3), 2 ranks: 0.035 ns
    per ring byte at 8 MiB, 0.071 at 32 MiB; 4 ranks: 0.11-0.25 at 8 MiB (noisy), 0.16-0.18 at 32 MiB. Fitted on
    256 KiB-8 MiB, the wide MLP's 256 MiB of gradients on 4 ranks was predicted to sum in 33 ms; they take ~75."""
    from autopar.comm.host_memory import HostGroup

    if device.type != "cpu" or not shared_memory_on():
        return None
    n, points = dist.get_world_size(), []
    for size in sizes:
        numel = max(size // 4, n)
        host = HostGroup.create(numel, signature=f"calibration {numel}")
        if host is None:
            return None
        host.region.fill_(1.0)

        def once(host=host, numel=numel):
            host.all_reduce_range(0, numel)
            host.settle()

        once()
        points.append((RING["all_reduce"](n) * size, _timed(once)))
    return _fit(points)


def _overlap(device, numel: int = 1 << 21) -> float:
    """1 - (both - longer) / shorter for an all-reduce and matrix products started together: 1 when the collective
    runs wholly beside the compute, 0 when they take turns (measured, not assumed: on a 2-core CPU host gloo's
    threads and the compute share the cores)."""
    buf = torch.ones(numel, device=device)
    a = torch.randn(256, 256, device=device)
    comm = _timed(lambda: dist.all_reduce(buf))
    one = _timed(lambda: a @ a)
    k = max(1, int(comm / max(one, 1e-7)))

    def compute():
        for _ in range(k):
            a @ a
        if device.type == "cuda":
            torch.cuda.synchronize()

    alone = _timed(compute)

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    together = _timed(both)
    shorter = max(min(comm, alone), 1e-9)
    return float(min(1.0, max(0.0, 1.0 - (together - max(comm, alone)) / shorter)))


def _turn_taking(device, rounds: int = 7) -> float | None:
    """Wall time / (CPU time x ranks per core) of a loop of matrix products with a small all-reduce after each, less
    the all-reduce's own time -- what ranks that share the cores lose to waiting for each other at every collective
    (:attr:`MachineModel.turn_taking`). None where compute is timed by the wall clock (a GPU, threaded ranks).

    Measured, not assumed: 4 ranks on this 2-core host computed 1.1-1.2x their CPU time x 2 between all-reduces
    15 ms of CPU apart (steps predicted 15-20 % fast from CPU times alone). Where every rank has a core of its own
    it is 1: a rank that waits leaves its own core idle, which the collective's measured time already holds.

    Seven rounds, the first dropped (it runs high: 1.13 where the rest gave 1.01-1.14), the median of the others:
    twelve rounds on a quiet host spread 0.93-1.23, and a median of three once gave 1.44 -- every 4-rank compute of
    that benchmark run 44 % dearer, its data-parallel steps predicted 31-38 % slow (``bench/auto_vs_hand.py``)."""
    from autopar.planner.op_timer import cpu_share, local_ranks

    share = cpu_share(device, local_ranks())
    if share <= 1.0:
        return None
    a, buf = torch.randn(256, 256, device=device), torch.ones(1024, device=device)

    def work():  # about 15 ms of CPU: the compute between two collectives of a step here
        for _ in range(48):
            a @ a

    def per_call(fn, reps: int = 6) -> tuple[float, float]:
        fn()
        dist.barrier()
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - wall) / reps, (time.thread_time() - cpu) / reps

    def both():
        work()
        dist.all_reduce(buf)

    ratios = []
    for _ in range(rounds):
        _, cpu = per_call(work)
        alone, _ = per_call(lambda: dist.all_reduce(buf))
        together, _ = per_call(both)
        box = torch.tensor([cpu, alone, together], dtype=torch.float64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        cpu, alone, together = box.tolist()
        ratios.append((together - alone) / max(share * cpu, 1e-9))
    return float(min(2.0, max(1.0, statistics.median(ratios[1:]))))


def _dispatch_seconds(device, layers: int = 4, repeats: int = 5) -> float:
    """Seconds one operator call costs on DTensors beyond the same call on their local tensors, as a network's
    operators run: a chain of linear, layer norm and ReLU, forward and backward, replicated (no collective).

    Why not one small element-wise operator: ``x + x`` takes DTensor's C++ fast path, 0.7 us over its local call
    on this CPU, where a linear, a convolution or a normalisation and their backward pay 15-50 us each (sharding
    propagation's cached lookup in Python, the wrapping and unwrapping of local tensors). Probed with ``x + x``, a
    layout of twenty replicated 16x16 linears was put at ~0.1 ms of dispatch a step and took 7.4 ms (0.4 ms as
    plain tensors). The result is per call, as :func:`autopar.planner.plan.dispatch_of` counts them: three per
    operator of the forward (its call and about two in the backward). The slowest rank's time."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from autopar.comm.topology import world_mesh

    mesh = world_mesh()
    width = 16
    made = [torch.randn(8, width), torch.randn(width, width), torch.randn(width), torch.ones(width),
            torch.zeros(width)]
    plain = [t.to(device).requires_grad_(i > 0) for i, t in enumerate(made)]
    laid = [distribute_tensor(t.to(device), mesh, [Replicate()] * mesh.ndim).requires_grad_(i > 0)
            for i, t in enumerate(made)]
    functional = torch.nn.functional

    def chain(x, w, b, g, beta):
        for _ in range(layers):
            x = functional.relu(functional.layer_norm(functional.linear(x, w, b), (width,), g, beta))
        x.sum().backward()

    from autopar.planner.op_timer import cpu_share, local_ranks

    # ranks on the CPU with a thread each: their CPU time times the ranks per core, as operators are timed
    share = cpu_share(device, local_ranks())
    clock = time.thread_time if share else time.perf_counter

    def per_step(tensors) -> float:
        chain(*tensors)  # warm-up (and sharding propagation's cache)
        best = float("inf")
        for _ in range(repeats):
            t0 = clock()
            chain(*tensors)
            best = min(best, clock() - t0)
        return best * (share or 1.0)

    extra = torch.tensor([max(0.0, per_step(laid) - per_step(plain))], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(extra, op=dist.ReduceOp.MAX)
    return float(extra) / (3 * 3 * layers)  # three operators a layer, each ~three calls forward and backward


def _optimizer_rates(device, numel: int = 4 << 20) -> dict:
    """Parameter bytes per second of an SGD-with-momentum step: fused on a plain tensor (data parallel) and the
    per-parameter loop on a replicated DTensor (the layout modes)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from autopar.comm.topology import world_mesh  # calibration runs inside the job

    rates = {}
    plain = torch.nn.Parameter(torch.randn(numel, device=device))
    plain.grad = torch.randn(numel, device=device)
    mesh = world_mesh()
    laid = torch.nn.Parameter(distribute_tensor(torch.randn(numel, device=device), mesh,
                                                [Replicate()] * mesh.ndim))
    laid.grad = distribute_tensor(torch.randn(numel, device=device), mesh, [Replicate()] * mesh.ndim)
    for kind, param, options in (("fused", plain, {"fused": True}), ("layout", laid, {})):
        try:
            opt = torch.optim.SGD([param], lr=1e-9, momentum=0.9, **options)
        except (RuntimeError, TypeError):  # no fused kernel here: what data parallel then runs
            opt = torch.optim.SGD([param], lr=1e-9, momentum=0.9)
        rates[kind] = _rate(opt.step, 4.0 * numel)
    return rates


def load_or_calibrate(force: bool = False) -> MachineModel:
    """The cached model of this job's machine, measured first if there is none (collective)."""
    from autopar.comm import management

    n = dist.get_world_size() if dist.is_initialized() else 1
    path = cache_path(management.backend() if management.is_initialized() else "gloo", n)
    have = torch.tensor([0 if force or not path.exists() else 1])
    if dist.is_initialized():
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
    if have.item():
        model = MachineModel.from_json(path.read_text())
    elif dist.is_initialized():
        model = calibrate()
        if dist.get_rank() == 0:
            write_atomic(path, model.to_json())
    else:
        model = MachineModel(device_num=1)
    model.memory_per_device = available_memory()
    from autopar.planner import op_timer

    if dist.is_initialized() and op_timer.enabled():  # in a job: operators timed on its own device
        model.op_timer = op_timer.OpTimer.for_this_host(management.device(), n, model.turn_taking)
    return model


def available_memory() -> float:
    """Bytes one process may use: free GPU memory, or the host's available memory shared by its local ranks."""
    from autopar.comm import management

    if management.is_initialized() and management.device().type == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return float(free)
    import psutil

    from autopar.planner.op_timer import local_ranks

    return float(psutil.virtual_memory().available) / max(local_ranks(), 1)


def main() -> None:  # pragma: no cover - run by ``autopar plan --calibrate`` through the launcher
    from autopar.comm.management import init

    init()
    model = load_or_calibrate(force=os.environ.get("AUTOPAR_RECALIBRATE") == "1")
    if dist.get_rank() == 0:
        print(model.to_json(), flush=True)


if __name__ == "__main__":  # pragma: no cover
    main()
