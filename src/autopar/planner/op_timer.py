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


def enabled() -> bool:
    return env_flag("AUTOPAR_MEASURE_OPS", True)


class OpTimer:
    """Forward and forward+backward seconds of single operators on ``device``, measured once per shape."""

    def __init__(self, device: torch.device, path: Path | None = None, together: bool = False):
        self.device = device
        self.path = path
        # in a job: every rank measures each shape at the same moment (as they will compute it: on a shared host
        # they contend for memory bandwidth) and keeps the slowest rank's time -- one number on every rank
        self.together = together
        self.table: dict[str, tuple[float, float]] = {}
        self.measured = 0  # shapes measured by this process (the rest came from the cache)
        if path is not None:
            try:
                self.table = {k: tuple(v) for k, v in json.loads(path.read_text()).items()}
            except (OSError, ValueError):
                self.table = {}

    @classmethod
    def for_this_host(cls, device: torch.device, world: int) -> "OpTimer":
        """Kept per host, thread count and world size: on a CPU the ranks share the cores, so an operator's time
        depends on how many run beside it (every rank measures at once, as they will compute at once)."""
        from autopar.planner.cache import cache_dir

        base = cache_dir()
        name = (f"ops-{device.type}-{socket.gethostname()}-c{os.cpu_count()}-t{torch.get_num_threads()}"
                f"-n{world}.json")
        import torch.distributed as dist

        return cls(device, base / name, together=dist.is_initialized() and dist.get_world_size() > 1)

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

        have = torch.tensor([1.0 if key in self.table else 0.0])
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if have.item():
            return self.table[key]
        try:
            result = tuple(measure())
        except Exception:  # noqa: BLE001
            result = None
        box = torch.tensor([-1.0, -1.0] if result is None else list(result), dtype=torch.float64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)  # (a rank that failed would have failed on all: same shapes)
        if box.min().item() < 0:
            self.table.pop(key, None)
            return None
        self.table[key] = tuple(float(v) for v in box)
        self.measured += 1
        return self.table[key]

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
            self._sync()
            self.barrier()
            t0 = time.perf_counter()
            with torch.no_grad():
                fn(inputs)
            self._sync()
            t1 = time.perf_counter()
            out = fn(inputs)
            out.backward(gout)
            self._sync()
            t2 = time.perf_counter()
            forward.append(t1 - t0)
            total.append(t2 - t1)
        return statistics.median(forward), statistics.median(total)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


_DTYPES = {8: torch.float64, 4: torch.float32, 2: torch.bfloat16}


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


def _step_seconds(timer: OpTimer, root: torch.nn.Module, inputs: tuple, kwargs: dict, device_num: int) -> tuple:
    import copy

    from torch.utils._pytree import tree_flatten, tree_map

    def share(t):
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] % device_num == 0:
            return t[: t.shape[0] // device_num].to(timer.device)
        return t

    with torch.random.fork_rng(devices=[timer.device] if timer.device.type == "cuda" else []):
        net = copy.deepcopy(root).train()
        args, kw = tree_map(share, tuple(inputs)), tree_map(share, dict(kwargs or {}))

        def step():
            out = net(*args, **kw)
            leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            sum(t.float().sum() for t in leaves).backward()
            timer._sync()

        step()  # warm-up: the allocator, the kernels' first calls (a network that cannot step on a slice fails here)
        times = []
        for _ in range(REPEATS):
            for p in net.parameters():
                p.grad = None
            timer.barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return seconds, seconds
