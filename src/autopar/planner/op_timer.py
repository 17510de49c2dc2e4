"""Operator costs measured on the job's own device, at the very shapes a strategy gives each rank.

Why: the roofline (FLOPs / one calibrated rate, or bytes / bandwidth) is right for large square products and wrong
by 2-3x for what small jobs are made of -- a weight gradient with 8-16 rows, a column slice of 512, a convolution
on a 4x4 map (``bench/auto_vs_hand.py``: the MLP's plans predicted 60 % fast). Measuring is cheap next to being
wrong: each distinct (operator, local shapes, dtype) runs its forward once to warm up, then forward and
forward + backward a few times (medians), and the result is kept per host and thread count in
``AUTOPAR_CACHE_DIR``, so a shape is measured once per machine, not once per job.

Used inside a job (:func:`autopar.planner.api.make_plan` gives the machine model a timer); ``autopar plan`` for a
cluster you do not have keeps the roofline of the machine file. ``AUTOPAR_MEASURE_OPS=0`` turns it off.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from autopar.context import env_flag

REPEATS = 3
# compute run before each timed half of a redistribution, on a CPU (:meth:`OpTimer._measure_reshard`)
SEGMENT_SECONDS = 4e-3
# the whole step (:func:`whole_step_seconds`): repeats after the warm-up, and how many of the last are kept -- a
# fresh copy's steps get faster for several steps while its heap grows (faulted in once, kept after); with one
# warm-up and the median of three, the wide MLP's step on 4 ranks once measured 486 ms of CPU where it takes 211-236
STEP_REPEATS, STEP_KEPT = 8, 5
OPTIMIZER_SAMPLE = 256 * 2**20  # parameter bytes the optimizer step is timed on (beyond: the rate of those)


def enabled() -> bool:
    return env_flag("AUTOPAR_MEASURE_OPS", True)


class OpTimer:
    """Forward and forward+backward seconds of single operators on ``device``, measured once per shape."""

    def __init__(self, device: torch.device, path: Path | None = None, together: bool = False,
                 local_ranks: int = 1, turn_taking: float | None = None):
        self.device = device
        self.path = path
        # in a job: every rank measures each shape at the same moment (as they will compute it: on a shared host
        # they contend for memory bandwidth) and keeps the slowest rank's time -- one number on every rank
        self.together = together
        # on a CPU with one thread per rank, compute is timed by the CPU time it takes, times how many ranks share
        # each core (:func:`cpu_share`); elsewhere by the wall clock
        # (and by how much more the ranks that share the cores lose to waiting for each other: machine.turn_taking)
        share = cpu_share(device, local_ranks)
        self.cpu_share = share * (turn_taking or 1.0)
        # more ranks than cores: a redistribution is timed by the rank that arrives at it last (:meth:`_least_rank`)
        self.oversubscribed = share > 1
        self.table: dict[str, tuple[float, float]] = {}
        self.measured = 0  # shapes measured by this process (the rest came from the cache)
        self._agreed: set[str] = set()  # keys every rank of this job holds already: no collective to look them up
        self._failed: set[str] = set()  # keys every rank failed to measure in this job: not tried again
        if path is not None:
            try:
                self.table = {k: tuple(v) for k, v in json.loads(path.read_text()).items()}
            except (OSError, ValueError):
                self.table = {}

    @classmethod
    def for_this_host(cls, device: torch.device, world: int, turn_taking: float | None = None) -> "OpTimer":
        """Kept per host, thread count and world size: on a CPU the ranks share the cores, so an operator's time
        depends on how many run beside it (every rank measures at once, as they will compute at once)."""
        import torch.distributed as dist

        from autopar.planner.cache import cache_dir

        local = local_ranks()
        name = (f"ops-v4-{device.type}-{socket.gethostname()}-c{os.cpu_count()}-t{torch.get_num_threads()}"
                f"-n{world}-l{local}.json")
        return cls(device, cache_dir() / name, together=dist.is_initialized() and dist.get_world_size() > 1,
                   local_ranks=local, turn_taking=turn_taking)

    def keep(self, key: str, values: tuple) -> None:
        """``table[key] = values``, measured elsewhere (every rank keeps the same), saved with the next ``save()``."""
        self.table[key] = tuple(float(v) for v in values)
        self._failed.discard(key)  # (looked for, and missing, earlier in this job)
        self.measured += 1

    def save(self) -> None:
        if self.path is None or not self.measured:
            return
        from autopar.planner.cache import write_atomic

        try:
            old = json.loads(self.path.read_text()) if self.path.exists() else {}
        except (OSError, ValueError):
            old = {}
        old.update({k: list(v) for k, v in self.table.items()})
        try:
            write_atomic(self.path, json.dumps(old))
        except OSError:  # a read-only cache: measured again next time
            pass

    # -- the operators ------------------------------------------------------------------------------------------
    def node(self, node, local_shapes: list[tuple]) -> tuple[float, float] | None:
        """(forward s, forward+backward s) of ``node`` (an :class:`~autopar.planner.graph.OpNode`) at ``local_shapes``
        (one per tensor input, this rank's slices); None for an operator it does not know."""
        dtype = _DTYPES.get(node.itemsize, torch.float32)
        target = node.target
        local_shapes = [tuple(int(v) for v in s) for s in local_shapes]
        if node.kind == "linear":
            key = ("linear", local_shapes[:3])
            return self._time(key, dtype, lambda t: F.linear(*t), local_shapes[:3], grads=(True, True, True))
        if node.kind == "conv":
            stride, padding = getattr(target, "stride", 1), getattr(target, "padding", 0)
            dilation, groups = getattr(target, "dilation", 1), getattr(target, "groups", 1)
            if not isinstance(padding, (int, tuple)):  # "same" / "valid": the module computes it
                return None
            # a split of the output channels splits the groups too (depth-wise convolutions)
            local_groups = max(1, groups * local_shapes[1][0] // max(1, node.shapes[1][0]))
            key = ("conv", local_shapes[:3], stride, padding, dilation, local_groups, type(target).__name__)
            forward = getattr(target, "_conv_forward", None)  # the module's own (a "same" padding it computes)
            if forward is not None and local_groups == groups:
                conv = lambda t: forward(t[0], t[1], t[2] if len(t) > 2 else None)  # noqa: E731
            else:
                conv = lambda t: F.conv2d(*t, stride=stride, padding=padding, dilation=dilation,  # noqa: E731
                                          groups=local_groups)
            return self._time(key, dtype, conv, local_shapes[:3], grads=(True,) * 3)
        if node.kind == "matmul":
            ta, tb = getattr(target, "transpose_a", False), getattr(target, "transpose_b", False)
            key = ("matmul", local_shapes[:2], ta, tb)

            def mm(t):
                a, b = t
                return (a.transpose(-1, -2) if ta else a) @ (b.transpose(-1, -2) if tb else b)

            return self._time(key, dtype, mm, local_shapes[:2], grads=(True, True))
        if node.kind == "softmax":
            axis = getattr(target, "axis", -1)
            key = ("softmax", local_shapes[:1], axis)
            return self._time(key, dtype, lambda t: torch.softmax(t[0], axis), local_shapes[:1], grads=(True,))
        return None

    def attention(self, shapes: list[tuple], itemsize: int, causal: bool) -> tuple[float, float] | None:
        """(forward s, forward+backward s) of torch's SDPA over query, key and value of ``shapes`` (this rank's),
        causal or not, grouped-query where the key has fewer heads -- the kernel the network calls, as it calls it
        (no mask: a masked call is timed unmasked)."""
        shapes = [tuple(int(v) for v in s) for s in shapes[:3]]
        gqa = len(shapes[0]) == 4 and shapes[0][1] != shapes[1][1]
        key = ("sdpa", shapes, causal)
        return self._time(key, _DTYPES.get(itemsize, torch.float32), lambda t: F.scaled_dot_product_attention(
            t[0], t[1], t[2], is_causal=causal, **({"enable_gqa": True} if gqa else {})), shapes, grads=(True,) * 3)

    def experts(self, module: torch.nn.Module, rows: int, width: int, k: int, parts: int,
                ranks: int) -> tuple[float, float] | None:
        """(data parallel's, expert parallelism's) forward+backward seconds of ``module`` -- a module of stacked
        experts, ``forward(hidden_states, top_k_index, top_k_weights)`` -- in a step of ``rows`` tokens of
        ``width`` routed to ``k`` experts each: every expert over this rank's ``rows / parts`` tokens, as data
        parallel runs it, against ``E / ranks`` experts over the tokens the all-to-all dispatcher brings this rank
        from every rank (those that chose one of its experts; the others' choices take the "no expert" slot), as
        :mod:`autopar.parallel.tensor.experts` runs it. The routing is uniform (``uniform_routing``). None where the
        module cannot be timed here (its weights not yet made, a forward that fails on the host).

        Why: per expert, a module of this form indexes its stacked weights (``gate_up_proj[e]``), and the backward
        of each index writes a gradient of the whole stack -- E experts' work grows as E x E, so the ranks' E / n
        experts over n times the tokens each cost far less than the FLOPs say: the benchmark's 8 experts of 1,024
        took 74-81 ms a rank under data parallel and 35 under expert parallelism on 2 ranks, at the same FLOPs;
        priced by FLOPs, expert parallelism was predicted 20-50 % slow."""
        from torch._subclasses.fake_tensor import is_fake

        from autopar.layout.leaves import uniform_routing

        experts = int(getattr(module, "num_experts", 0) or 0)
        stacked = {a: p for a, p in module._parameters.items()
                   if p is not None and p.dim() >= 2 and p.shape[0] == experts}
        if not experts or experts % ranks or not stacked or any(
                p.is_meta or is_fake(p) for p in module.parameters()):
            return None
        dtype = next(iter(stacked.values())).dtype
        shapes = tuple((a, tuple(p.shape)) for a, p in stacked.items())
        key = ("experts", type(module).__qualname__, shapes, rows, width, k, parts, ranks)

        def measure() -> tuple[float, float]:
            generator = torch.Generator().manual_seed(0)
            index = uniform_routing(rows, experts, k, torch.long, seed=0)
            weights = torch.rand(rows, k, generator=generator).to(dtype)
            hidden = torch.randn(rows, width, generator=generator).to(dtype)
            per, mine = experts // ranks, index < experts // ranks  # the first rank's experts
            came = mine.any(-1)
            share = rows // parts
            return (self._experts_seconds(module, stacked, experts, hidden[:share], index[:share], weights[:share]),
                    self._experts_seconds(module, stacked, per, hidden[came],
                                          torch.where(mine, index, torch.full_like(index, per))[came],
                                          weights.masked_fill(~mine, 0)[came]))

        return self.agreed(repr(key), measure)

    def _experts_seconds(self, module, stacked: dict, count: int, hidden, index, weights) -> float:
        """:meth:`typical` forward+backward seconds of ``module`` holding the first ``count`` of its experts (fresh
        copies of its stacked weights, put back after), over ``hidden`` routed by ``index`` / ``weights``."""
        from autopar.layout.leaves import holding_experts

        device, experts = self.device, module.num_experts
        others = [p for p in module.parameters() if all(p is not q for q in stacked.values())]
        grads = [p.grad for p in others]
        hidden, index, weights = hidden.to(device), index.to(device), weights.to(device)
        copies = {a: torch.nn.Parameter(p.detach()[:count].clone().to(device)) for a, p in stacked.items()}
        x = hidden.clone().requires_grad_(True)

        def once():
            x.grad = None
            for p in copies.values():
                p.grad = None
            out = type(module).forward(module, x, index, weights)
            out.backward(torch.ones_like(out))

        try:
            with holding_experts(module, copies, count, split=count < experts):
                once()  # warm-up
                return self._repeated(once)
        finally:
            for p, g in zip(others, grads):
                p.grad = g

    def _time(self, key: tuple, dtype: torch.dtype, fn, shapes: list[tuple], grads: tuple) -> tuple[float, float] | None:
        return self.agreed(repr((key, str(dtype))), lambda: self._measure(dtype, fn, shapes, grads))

    def agreed(self, key: str, measure) -> tuple | None:
        """``table[key]``, measured by ``measure()`` (a pair of seconds) where it is not there yet; None where it
        cannot be measured. In a job (``together``) the ranks first agree that one of them lacks it -- a cache on one
        host and not another must not leave a rank waiting -- then every rank measures and the slowest rank's
        numbers are kept on all of them. ``measure`` raises (the same on every rank) before its first barrier."""
        if not self.together:
            if key not in self.table:
                try:
                    self.table[key] = tuple(measure())
                except Exception:  # noqa: BLE001 - what this timer cannot rebuild: the roofline costs it
                    return None
                self.measured += 1
            return self.table[key]
        import torch.distributed as dist

        if key in self._agreed:
            return self.table[key]
        if key in self._failed:
            return None
        have = torch.tensor([1.0 if key in self.table else 0.0])
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if have.item():
            self._agreed.add(key)
            return self.table[key]
        try:
            result = tuple(measure())
        except Exception:  # noqa: BLE001
            result = None
        box = torch.tensor([-1.0, -1.0] if result is None else list(result), dtype=torch.float64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)  # (a rank that failed would have failed on all: same shapes)
        if box.min().item() < 0:
            self.table.pop(key, None)
            self._failed.add(key)
            return None
        self.table[key] = tuple(float(v) for v in box)
        self._agreed.add(key)
        self.measured += 1
        return self.table[key]

    # -- the redistributions between them ----------------------------------------------------------------------
    def reshard(self, src: tuple, dst: tuple, shape: tuple, itemsize: int, grad: tuple | None = None,
                backward: bool = True) -> float | None:
        """Forward + backward seconds of DTensor's redistribution of a tensor of global ``shape`` from placements
        ``src`` to ``dst`` on the job's world mesh -- the very call the layout runtime makes between two operators
        (:func:`autopar.parallel.tensor.operators.run_operator`). None outside a job or where DTensor cannot take
        the pair (the planner's alpha-beta model of the collectives costs it then).

        Why: the model's collectives were right for a plain all-reduce and wrong for what DTensor runs. A partial
        sum scattered over a dimension other than the first copies its chunks around the collective; gloo has no
        all-to-all, so a change of split dimension gathers the whole tensor; a 2-D mesh redistributes one axis at a
        time. On 4 CPU ranks the alpha-beta model put these 0.5-2x of their measured times, and ranked chains of
        row-split Linears above Megatron's pairs, which measured 20 % faster.

        ``grad``: the placements of the gradient the consumer hands back (the runtime's ``to_local(grad_placements=
        ...)``): a partial sum where the consumer's other operand is split, reduced by the backward of this very
        redistribution -- a reduce-scatter on the feature dimension where a column-split Linear feeds another.

        ``backward=False``: the forward's seconds alone, for a tensor no gradient flows back into (the batch)."""
        grad = tuple(dst) if grad is None or not backward else tuple(grad)
        if not self.together or (tuple(src) == tuple(dst) and grad == tuple(dst)):
            return None
        from torch.distributed.tensor import Partial, Replicate, Shard

        def name(p):
            if isinstance(p, Shard):
                return f"S{p.dim}" if p.dim < len(shape) else None
            if isinstance(p, Partial):
                return "P" if p.reduce_op == "sum" else None
            return "R" if isinstance(p, Replicate) else None

        names = [name(p) for p in tuple(src) + tuple(dst) + grad]
        if None in names:  # a split the producer's view does not carry (costs.through_view): not a real layout
            return None
        dtype = _DTYPES.get(itemsize, torch.float32)
        k = len(src)
        key = ("reshard", tuple(int(v) for v in shape), "".join(names[:k]), "".join(names[k:2 * k]), str(dtype))
        if grad != tuple(dst):
            key += ("grad " + "".join(names[2 * k:]),)
        measured = self.agreed(repr(key), lambda: self._measure_reshard(tuple(src), tuple(dst), tuple(shape), dtype,
                                                                        grad))
        return None if measured is None else measured[1 if backward else 0]

    def _measure_reshard(self, src: tuple, dst: tuple, shape: tuple, dtype: torch.dtype,
                         grad: tuple) -> tuple[float, float]:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        from autopar.comm.topology import world_mesh

        mesh = world_mesh()
        if len(src) != mesh.ndim or len(dst) != mesh.ndim or len(grad) != mesh.ndim:
            raise ValueError("placements of another mesh")
        local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, list(src))
        stride = torch.empty(shape, device="meta").stride()
        torch.manual_seed(0)
        local = torch.randn(local_shape, dtype=dtype, device=self.device)

        busy = self._busy()

        def once() -> tuple[float, float]:
            x = local.detach().requires_grad_()
            busy()
            t0 = time.perf_counter()
            y = DTensor.from_local(x, mesh, src, run_check=False, shape=torch.Size(shape), stride=stride)
            out = y.redistribute(mesh, dst).to_local(grad_placements=grad)
            self._sync()
            forward = time.perf_counter() - t0
            busy()
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            self._sync()
            return forward, forward + time.perf_counter() - t1

        once()  # warm-up (and DTensor's redistribution plan, cached per pair)
        forward, total = [], []
        for _ in range(REPEATS):
            self.barrier()
            f, t = once()
            forward.append(f)
            total.append(t)
        times = statistics.median(forward), statistics.median(total)
        return self._least_rank(times) if self.oversubscribed else times

    def _least_rank(self, times: tuple[float, ...]) -> tuple[float, ...]:
        """The least of every rank's ``times``, on all of them: where ranks outnumber the cores, a redistribution's
        cost is what the rank that arrives last waits for it.

        Why: four ranks on two cores end a timed compute segment a time slice apart -- two run while two wait for a
        core. Each of the first to arrive times that slice as waiting; in a step the other ranks fill it with their
        own compute, which the operators' CPU time times the ranks per core already counts. Timed by the slowest
        rank, ResNet-50 split by output channels on 4 ranks was predicted 3.89 s a step where it took 2.77: its ~110
        parameter all-reduces at 9-12 ms each where they took 4-6 in the step, its activation redistributions 2.32 s
        where they took 1.75. The rank that arrives last timed them within ~10 % of the step's (a 128x1024x2x2
        gather: 18.5 ms, 18.6 in the step). With a core per rank there is no such slice: the slowest rank's time is
        kept."""
        import torch.distributed as dist

        box = torch.tensor(list(times), dtype=torch.float64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN)
        return tuple(float(v) for v in box)

    def _busy(self):
        """What runs before each half of a timed redistribution, as an operator's compute does in a step: on a CPU,
        :data:`SEGMENT_SECONDS` of matrix products (elsewhere nothing).

        Why: on a CPU host a collective that follows compute takes longer than one that follows a barrier -- a
        64 KiB all-reduce between 2 ranks on this 2-core host: 0.35 ms after a barrier, 0.45 after 2.5 ms of
        products, 1.09 after 15 ms; a redistribution's forward and backward (64 KiB to 1 MiB a rank) 1-3 ms more
        after 2-5 ms of compute. Timed after a barrier, the layouts of ``bench/auto_vs_hand.py`` on 2 ranks, with
        20-320 redistributions a step, were predicted 18-34 % fast; their in-step waits were that much longer."""
        if self.device.type != "cpu":
            return lambda: None
        a = torch.randn(128, 128)

        def busy():
            start = time.perf_counter()
            while time.perf_counter() - start < SEGMENT_SECONDS:
                a @ a

        return busy

    # -- the optimizer step ------------------------------------------------------------------------------------
    def optimizer_rates(self, network: torch.nn.Module, device_num: int) -> dict | None:
        """Parameter bytes per second of an SGD-with-momentum step over ``network``'s own parameters, as the job
        will run it: "fused" -- data parallel's plain tensors, the fused kernel -- and "layout" -- this rank's
        slices as DTensors, stepped one by one (the fused kernels do not take DTensors); and "scale" -- a layout's
        gradients multiplied by ``gradients_mean``'s factor (:meth:`_scale_rate`). None outside a job.

        Why: calibrated once on a 16 MiB tensor, whose parameter, gradient and momentum partly stay in the caches,
        the layout step was put at 11.8 GB/s where the wide MLP's 128 MiB of slices stepped at 4 GB/s on 2 ranks
        (31-36 ms predicted as 11). Measured on the job's own shapes (at most :data:`OPTIMIZER_SAMPLE` bytes of
        them), every rank at once, kept per shapes like the operators."""
        if not self.together:
            return None
        params = [p for p in network.parameters() if p.requires_grad and p.is_floating_point()]
        shapes, total = [], 0
        for p in params:
            if total >= OPTIMIZER_SAMPLE:
                break
            shapes.append((tuple(p.shape), p.element_size()))
            total += p.numel() * p.element_size()
        if not shapes:
            return None
        key = repr(("optimizer and scale", tuple(shapes), device_num))
        measured = self.agreed(key, lambda: self._measure_optimizer(shapes, device_num))
        return None if measured is None else {"fused": measured[0], "layout": measured[1], "scale": measured[2]}

    def _measure_optimizer(self, shapes: list, device_num: int) -> tuple[float, float, float]:
        from torch.distributed.tensor import Replicate, distribute_tensor

        from autopar.comm.topology import world_mesh

        mesh = world_mesh()

        def rate(params: list, fused: bool) -> float:
            for q in params:
                q.grad = torch.ones_like(q)
            try:
                opt = torch.optim.SGD(params, lr=1e-9, momentum=0.9, fused=fused or None)
            except (RuntimeError, TypeError):  # no fused kernel here: what data parallel then runs
                opt = torch.optim.SGD(params, lr=1e-9, momentum=0.9)
            opt.step()  # warm-up: the momentum buffers
            nbytes = sum(q.numel() * q.element_size() for q in params)
            return nbytes / max(self._repeated(opt.step), 1e-9)

        whole = [torch.nn.Parameter(torch.zeros(s, dtype=_DTYPES.get(i, torch.float32), device=self.device))
                 for s, i in shapes]
        fused = rate(whole, True)
        del whole

        def piece(shape):  # this rank's slice of a layout: the first dimension split where it can be
            return (shape[0] // device_num, *shape[1:]) if shape and shape[0] % device_num == 0 else shape

        laid = [torch.nn.Parameter(distribute_tensor(torch.zeros(piece(s), dtype=_DTYPES.get(i, torch.float32),
                                                                 device=self.device), mesh, [Replicate()] * mesh.ndim))
                for s, i in shapes]
        layout = rate(laid, False)
        grads = [q.grad._local_tensor for q in laid]
        del laid
        return fused, layout, self._scale_rate(grads)

    def _scale_rate(self, grads: list[torch.Tensor]) -> float:
        """Gradient bytes per second of ``gradients_mean``'s pass over a layout's gradients: each rank's slices
        multiplied in place, one by one, after the backward (:class:`autopar.parallel.grads.layouts.LayoutGrads`).
        Why: nothing else in a layout's step reads every gradient once more -- on the wide MLP's 128 MiB of slices
        on 2 ranks it took 6 ms of a 120 ms step that no operator's time held."""
        def scale():
            for g in grads:
                g.mul_(0.5)

        scale()  # warm-up
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        return nbytes / max(self._repeated(scale), 1e-9)

    def _repeated(self, fn) -> float:
        """:meth:`typical` seconds of ``fn`` over :data:`REPEATS` calls, every rank starting each together."""
        times = []
        for _ in range(REPEATS):
            self.barrier()
            t0 = self.clock()
            fn()
            self._sync()
            times.append(self.clock() - t0)
        return self.typical(times)

    def barrier(self) -> None:
        """In a job, every rank starts the next timed repeat together (as they compute together in a step)."""
        if self.together:
            import torch.distributed as dist

            dist.barrier()

    def _measure(self, dtype: torch.dtype, fn, shapes: list[tuple], grads: tuple) -> tuple[float, float]:
        torch.manual_seed(0)
        inputs = [torch.randn(s, dtype=dtype, device=self.device, requires_grad=g) for s, g in zip(shapes, grads)]
        out = fn(inputs)
        gout = torch.randn_like(out)
        out.backward(gout)  # warm-up: the allocator and the kernels' first calls
        forward, total = [], []
        for _ in range(REPEATS):
            for t in inputs:  # a step's gradients are made anew (zero_grad(set_to_none=True)), not added to
                t.grad = None
            self._sync()
            self.barrier()
            t0 = self.clock()
            with torch.no_grad():
                fn(inputs)
            self._sync()
            t1 = self.clock()
            out = fn(inputs)
            out.backward(gout)
            self._sync()
            t2 = self.clock()
            forward.append(t1 - t0)
            total.append(t2 - t1)
        return self.typical(forward), self.typical(total)

    def typical(self, times: list[float]) -> float:
        """One number for repeated timings: their median, by the CPU clock scaled by the ranks per core. (Not the
        least: ranks that start together drift apart, and the least of three CPU times is the repeat in which the
        others' memory traffic overlapped least -- the wide MLP's products on 2 ranks were predicted 30 % fast.)"""
        return self.cpu_share * statistics.median(times) if self.cpu_share else statistics.median(times)

    def clock(self) -> float:
        """Seconds for timing compute: where :attr:`cpu_share` applies, the CPU time of this thread (which runs the
        operators and, on a CPU, their backward; the process's other threads -- rank 0's store server, a
        heartbeat -- are not the network's work), else wall time."""
        return time.thread_time() if self.cpu_share else time.perf_counter()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


_DTYPES = {8: torch.float64, 4: torch.float32, 2: torch.bfloat16}


def local_ranks() -> int:
    """Ranks of this job on this host (1 outside a job): those that share its cores."""
    from autopar.comm import management

    return management.get_local_size() if management.is_initialized() else 1


def cpu_share(device: torch.device, local_ranks: int) -> float:
    """How many ranks share each core of this host (at least 1) where compute is best timed by its CPU time --
    ranks on the CPU with one thread each -- else 0 (time by the wall clock).

    Why: four ranks on two cores take turns. Timed by the wall clock, an operator that every rank starts at once
    lasted 1x or 2x its work by the luck of the scheduler (the same 4 MiB product measured 8.6 and 19.5 ms in two
    jobs, and the plans built on such numbers 2x apart). Its CPU time is the work itself, steady to a few percent,
    and a step whose ranks all compute takes that work times the ranks per core."""
    if device.type != "cpu" or torch.get_num_threads() != 1:
        return 0.0
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1.0, local_ranks / max(cores, 1))


# -- the whole network ------------------------------------------------------------------------------------------
def whole_step_seconds(timer: OpTimer, key: str, root: torch.nn.Module, inputs: tuple, kwargs: dict,
                       device_num: int) -> float | None:
    """Forward + backward seconds of ``root`` (the network with its loss) on this rank's share of the batch -- the
    compute of a data-parallel step, measured whole on the job's device (every rank at once, as they will run).

    Why: the operators the planner times one by one are not all a step does. Normalisations, activations, the
    residual adds, the reshapes of attention's heads, the loss and autograd's own bookkeeping run between them; the
    roofline put them at 1-2 ms where they measured 12-14 ms on the transformer and Llama blocks of
    ``bench/auto_vs_hand.py`` (every plan predicted 11-15 % fast). The difference between this and the timed
    operators is what every plan pays beside its operators. Run on a deep copy in training mode (BatchNorm's
    statistics, the parameters' gradients and the random generators of the caller are left as they were); cached
    per (graph, shapes) like the operators. None where it cannot run (the slice of the batch does not suit it).
    In a job the ranks measure together and keep the slowest rank's time (a step ends when its last rank does)."""
    seconds = timer.agreed(key, lambda: _step_seconds(timer, root, inputs, kwargs, device_num))
    return None if seconds is None else seconds[0]


def rank_share(timer, inputs: tuple, kwargs: dict, device_num: int) -> tuple[tuple, dict]:
    """This rank's share of a global batch (the first 1/n of every tensor whose first dimension n divides), on the
    timer's device: what each rank of a data-parallel step computes on."""
    from torch.utils._pytree import tree_map

    def share(t):
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] % device_num == 0:
            return t[: t.shape[0] // device_num].to(timer.device)
        return t

    return tree_map(share, tuple(inputs)), tree_map(share, dict(kwargs or {}))


def _step_seconds(timer: OpTimer, root: torch.nn.Module, inputs: tuple, kwargs: dict, device_num: int) -> tuple:
    import copy

    from torch.utils._pytree import tree_flatten

    with torch.random.fork_rng(devices=[timer.device] if timer.device.type == "cuda" else []):
        net = copy.deepcopy(root).train()
        args, kw = rank_share(timer, inputs, kwargs, device_num)

        def step():
            out = net(*args, **kw)
            leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            sum(t.float().sum() for t in leaves).backward()
            timer._sync()

        step()  # warm-up: the allocator, the kernels' first calls (a network that cannot step on a slice fails here)
        times = []
        for _ in range(STEP_REPEATS):
            for p in net.parameters():  # made anew, as where the operators are timed
                p.grad = None
            timer.barrier()
            t0 = timer.clock()
            step()
            times.append(timer.clock() - t0)
    seconds = timer.typical(times[-STEP_KEPT:])
    return seconds, seconds
