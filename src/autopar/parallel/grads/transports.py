"""How a bucket of gradients is summed over the ranks -- the transports of :mod:`autopar.parallel.grads.buckets` --
and :func:`reduce_now`, the same sum for tensors at hand (gradients ``torch.autograd.grad`` returned, a pipeline's
replicas after its schedule)."""
from __future__ import annotations

import queue
import threading
from typing import Callable

import torch
import torch.distributed as dist

from autopar.comm.host_memory import HostGroup

DEFAULT_BUCKET_MB = 25.0


class GroupTransport:
    """Sums through a ``torch.distributed`` process group: one asynchronous all-reduce per bucket."""

    name = "process group"

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, group=None):
        self.region = torch.zeros(numel, dtype=dtype, device=device)
        self.group = group
        self._works: list = []

    def owned(self, start: int, stop: int) -> tuple[int, int]:
        return start, start  # nothing is summed straight from a fresh gradient: every gradient is copied in

    def reduce(self, start: int, stop: int, own: list, scale: float, done: Callable[[], None]) -> None:
        self._works.append((dist.all_reduce(self.region[start:stop], group=self.group, async_op=True), done))

    def wait(self) -> None:
        works, self._works = self._works, []
        for work, done in works:
            work.wait()
            done()

    def drain(self) -> None:
        self._works = []

    def settle(self) -> None:
        pass

    def close(self) -> None:
        """Nothing runs beside the caller: nothing to end."""


class HostTransport:
    """Sums through one shared-memory segment of the host's ranks, a bucket at a time on a background thread (summed
    inline, every bucket was a rendezvous: measured, each rank sat idle 20-28 ms per ResNet-50 step)."""

    name = "shared memory"

    def __init__(self, host: HostGroup):
        self.host = host
        self.region = host.region
        self.failure: BaseException | None = None
        self._work: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def owned(self, start: int, stop: int) -> tuple[int, int]:
        return self.host.owned(start, stop)

    def reduce(self, start: int, stop: int, own: list, scale: float, done: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._sum, name="autopar-host-sum", daemon=True)
            self._thread.start()
        self._work.put((start, stop, own, scale, done))

    def _sum(self) -> None:
        with torch.no_grad():
            while True:
                item = self._work.get()
                if item is None:  # close(): the thread ends, and with it its hold on the segment
                    self._work.task_done()
                    return
                start, stop, own, scale, done = item
                try:
                    if self.failure is None:
                        self.host.all_reduce_range(start, stop, own, scale)
                        done()
                except BaseException as e:  # noqa: BLE001 -- raised again in the training thread
                    self.failure = e
                finally:
                    self._work.task_done()

    def wait(self) -> None:
        self._work.join()
        if self.failure is not None:
            raise self.failure

    def drain(self) -> None:
        self._work.join()  # a backward that raised may have left buckets with the summing thread

    def settle(self) -> None:
        self.host.settle()

    def close(self) -> None:
        """End the summing thread once its queued buckets are done (a reducer made for one measurement: the
        planner's data-parallel step, :mod:`autopar.parallel.data.step_timer`)."""
        if self._thread is not None:
            self._work.put(None)
            self._thread.join()
            self._thread = None


def reduce_now(tensors: list[torch.Tensor], group=None, scale: float = 1.0, *, into: bool = False,
               bucket_mb: float = DEFAULT_BUCKET_MB) -> list[torch.Tensor]:
    """Sum ``tensors`` over ``group`` now, as few collectives as buckets of ``bucket_mb`` allow (one per bucket of
    one dtype and device), each scaled by ``scale``. Returns the sums (fresh tensors), or with ``into`` writes them
    back into ``tensors``."""
    out: list = list(tensors)
    limit = max(1, int(bucket_mb * 2**20))
    runs: dict[tuple, list[list[int]]] = {}
    size: dict[tuple, int] = {}
    for i, t in enumerate(tensors):
        if t is None:
            continue
        key = (t.dtype, t.device)
        kind = runs.setdefault(key, [[]])
        if kind[-1] and size[key] + t.nbytes > limit:
            kind.append([])
            size[key] = 0
        kind[-1].append(i)
        size[key] = size.get(key, 0) + t.nbytes
    for run in (run for kind in runs.values() for run in kind):
        flat = torch.cat([tensors[i].reshape(-1) for i in run])
        if scale != 1.0:
            flat.mul_(scale)
        dist.all_reduce(flat, group=group)
        at = 0
        for i in run:
            n = tensors[i].numel()
            piece = flat[at:at + n].view_as(tensors[i])
            if into:
                tensors[i].copy_(piece)
            else:
                out[i] = piece
            at += n
    return tensors if into else out
