"""Gradient sums through shared memory, for ranks that share one host.

Why: gloo sums over loopback TCP. On a CPU host whose cores the training already saturates, its copies into and out
of the kernel are CPU work the step pays for (ResNet-50's 90 MB of gradients: ~42 ms of CPU per rank per step, most
of it system time -- ``bench/allreduce_floor.py``). Ranks on one host can read each other's memory instead.

The scheme is the one shared-memory engines use (DeepSpeed's CPU all-reduce, MPI's shared-memory transports): every
rank owns a region of one shared segment the size of the buffers it sums, and a range of it is summed in place by
a reduce-scatter (rank r adds the other ranks' r-th slices to its own) and an all-gather (each rank copies the other
slices' sums). Gradients that *live* in a rank's region (the reducer in :mod:`autopar.parallel.grads.buckets` makes
them views of it) need no copy in or out: per rank a range costs 1.5x its size in reads and writes for the sum
and 1x for the gather, against gloo's copies through the kernel.

Exactness: each element is summed once, by the rank that owns its slice, in a fixed order (its own value, then the
other ranks' in rank order), and copied to the others: every rank gets bit-identical sums. For two ranks the sum is
a + b, exactly what gloo computes.

Synchronisation is three monotonic counters per rank in the segment's header (a range is published, summed, gathered),
polled with short sleeps, never spinning a core the training needs. A rank that dies mid-sum is noticed by the
others within ``_LIVENESS_S`` (its process is gone) and the collective timeout bounds everything else: both raise
:class:`~autopar.errors.CommError`, nothing hangs. The segment is unlinked as soon as every rank has mapped it, so
nothing is left in ``/dev/shm`` however the job ends.
"""
from __future__ import annotations

import contextlib
import os
import platform
import socket
import time
import uuid

import torch
import torch.distributed as dist

from autopar.cluster.processes import process_alive
from autopar.errors import CommError

_HEADER_WORDS = 8  # per rank, int64: pid, published, summed, gathered, (rank 0) token; the rest pads a cache line
_PID, _PUBLISHED, _SUMMED, _GATHERED, _TOKEN = 0, 1, 2, 3, 4
# The counters are plain loads and stores: a rank's data writes are seen before its counter's only where the CPU
# keeps stores in order (x86's total store order). Elsewhere (aarch64) gloo stays.
_TSO_MACHINES = ("x86_64", "amd64", "i686", "i386")
_LIVENESS_S = 0.25  # how often a waiting rank checks that the ranks it waits for are still running
_SHM_DIR = "/dev/shm"


def host_identity() -> tuple[str, str, tuple[int, int]]:
    """What two processes on one host (one kernel, one network namespace) share: hostname, boot id, netns inode.

    The network namespace counts: the multi-host tests build their hosts as namespaces of one machine, and ranks in
    different namespaces are meant to talk as separate hosts do."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        # the network namespace (a test's namespace "hosts") and the pid namespace (a peer's pid must mean the same
        # process here, for the liveness check)
        netns = (os.stat("/proc/self/ns/net").st_ino, os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        boot, netns = "", (0, 0)
    return socket.gethostname(), boot, netns


class HostGroup:
    """One shared segment for the ranks of a process group that all run on this host: a float32 region per rank.

    Create it with :meth:`create` (a collective of the group); it returns None when the ranks are not all on one host
    or the segment cannot be had (the caller keeps gloo)."""

    def __init__(self, path: str, rank: int, world: int, numel: int, timeout_s: float, token: int | None = None):
        self.rank, self.world, self.numel, self.timeout_s = rank, world, numel, timeout_s
        header_bytes = world * _HEADER_WORDS * 8
        self._buffer = torch.from_file(path, shared=True, size=header_bytes + world * numel * 4, dtype=torch.uint8)
        # the counters as a numpy view: polling them is a plain load, not a torch call
        self.flags = self._buffer[:header_bytes].view(torch.int64).numpy().reshape(world, _HEADER_WORDS)
        self.regions = [self._buffer[header_bytes + r * numel * 4: header_bytes + (r + 1) * numel * 4]
                        .view(torch.float32) for r in range(world)]
        if token is not None:  # the creator: a fresh header, and the token the others check
            self.flags[:, :] = 0
            self.flags[0, _TOKEN] = token
        self.flags[rank, _PID] = os.getpid()
        self.seq = 0  # ranges summed so far; the same sequence on every rank
        self.peers = [p for p in range(world) if p != rank]

    @property
    def region(self) -> torch.Tensor:
        """This rank's region: what it puts there is summed by :meth:`all_reduce_range`."""
        return self.regions[self.rank]

    @classmethod
    def create(cls, numel: int, group=None, timeout_s: float | None = None, *, willing: bool = True,
               signature: str = "") -> "HostGroup | None":
        """Collective over ``group``: map one segment of ``world`` regions of ``numel`` floats, or return None.

        Every rank calls it, ``willing`` or not (a rank that cannot use it says so here: all ranks then keep gloo
        together). ``signature`` describes how the caller lays out its values (parameter shapes, buckets): ranks
        that disagree would sum unrelated numbers, so that is an error."""
        from autopar.cluster.env import comm_timeout

        world, rank = dist.get_world_size(group), dist.get_rank(group)
        usable = willing and os.path.isdir(_SHM_DIR) and platform.machine().lower() in _TSO_MACHINES
        seen: list = [None] * world
        dist.all_gather_object(seen, (host_identity(), usable, numel, signature), group=group)
        if world < 2 or any(s[0] != seen[0][0] or not s[1] for s in seen):
            return None
        if any(s[2:] != (numel, signature) for s in seen):
            raise CommError(f"the ranks lay out different gradients ({sorted({s[2] for s in seen})} values): "
                            "every rank must build the same network with the same settings")
        token = [None, None]
        if rank == 0:
            token = [_reserve(os.path.join(_SHM_DIR, f"autopar-{uuid.uuid4().hex}"),
                              world * _HEADER_WORDS * 8 + world * numel * 4), uuid.uuid4().int >> 65]
        path, engine = token[0], None
        try:
            if rank == 0 and path is not None:  # the token proves to the others that they mapped this very file
                with contextlib.suppress(Exception):
                    engine = cls(path, rank, world, numel, timeout_s or comm_timeout(), token=token[1])
            dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                       group=group)
            path = token[0]
            if path is None:
                return None
            if rank != 0:
                try:  # a private /dev/shm (another container) has no such file: never create one here
                    engine = cls(path, rank, world, numel, timeout_s or comm_timeout()) if os.path.exists(path) \
                        else None
                except Exception:  # noqa: BLE001 -- any failure to map means: keep gloo, on every rank
                    engine = None
            ok = engine is not None and int(engine.flags[0, _TOKEN]) == token[1]
            oks: list = [None] * world
            dist.all_gather_object(oks, ok, group=group)  # every rank has mapped it (or failed): nobody opens it again
        finally:
            if rank == 0 and path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        return engine if all(oks) else None

    # -- the collective ---------------------------------------------------------------------------------------
    def owned(self, start: int, stop: int) -> tuple[int, int]:
        """The slice of ``[start, stop)`` this rank sums (and the others copy from it)."""
        bounds = _split(start, stop, self.world)
        return bounds[self.rank], bounds[self.rank + 1]

    def all_reduce_range(self, start: int, stop: int, own: list[tuple[int, torch.Tensor]] = (),
                         own_scale: float = 1.0) -> None:
        """Sum ``[start, stop)`` of every rank's region into every rank's region, in place.

        ``own``: pieces ``(offset, values)`` of this rank's slice (:meth:`owned`) whose contribution is not in the
        region but in ``values`` (times ``own_scale``): summed from there, they need no copy into the region first.
        Every rank calls it for the same ranges in the same order; a rank's region there must not change until
        the call returns (a range is read by the other ranks until then)."""
        self.seq += 1
        seq, me = self.seq, self.rank
        bounds = _split(start, stop, self.world)
        self._publish(_PUBLISHED, seq)
        self._wait(_PUBLISHED, seq, "publish its gradients")
        mine = self.regions[me]
        for lo, hi, values in _cover(bounds[me], bounds[me + 1], own):
            out, others = mine[lo:hi], [self.regions[p][lo:hi] for p in self.peers]
            # one order, on one rank: this rank's value first, then the others' in rank order
            if values is None:
                for other in others:
                    out.add_(other)
            else:
                torch.add(others[0], values, alpha=own_scale, out=out)
                for other in others[1:]:
                    out.add_(other)
        self._publish(_SUMMED, seq)
        self._wait(_SUMMED, seq, "sum its slice")
        for p in self.peers:
            lo, hi = bounds[p], bounds[p + 1]
            if hi > lo:
                mine[lo:hi].copy_(self.regions[p][lo:hi])
        self._publish(_GATHERED, seq)

    def settle(self) -> None:
        """Wait until every rank has gathered every range summed so far: after it, a rank may write its region
        again (the next backward, ``zero_grad``) without changing what another rank still reads."""
        if self.seq:
            self._wait(_GATHERED, self.seq, "gather the sums")

    # -- counters ----------------------------------------------------------------------------------------------
    def _publish(self, column: int, seq: int) -> None:
        self.flags[self.rank, column] = seq

    def _wait(self, column: int, seq: int, what: str) -> None:
        flags, peers = self.flags, self.peers
        for _ in range(64):  # the common case: the others are there already, or within microseconds
            if all(flags[p, column] >= seq for p in peers):
                return
        start = time.monotonic()
        checked = start
        pause = 2e-5
        while not all(flags[p, column] >= seq for p in peers):
            time.sleep(pause)
            pause = min(pause * 2, 2e-4)  # a late wake-up delays the step: sleep at most 0.2 ms at a time
            now = time.monotonic()
            if now - checked >= _LIVENESS_S:
                checked = now
                late = [p for p in peers if flags[p, column] < seq]
                dead = [p for p in late if flags[p, _PID] > 0 and not process_alive(int(flags[p, _PID]))]
                if dead:
                    raise CommError(f"rank {dead[0]} (pid {int(flags[dead[0], _PID])}) exited while rank {self.rank}"
                                    f" waited for it to {what} in the shared-memory all-reduce")
                if now - start > self.timeout_s:
                    raise CommError(f"shared-memory all-reduce timed out after {self.timeout_s:.0f} s: rank {late[0]}"
                                    f" did not {what} (AUTOPAR_COMM_TIMEOUT)")


def _cover(lo: int, hi: int, pieces) -> list[tuple[int, int, torch.Tensor | None]]:
    """``[lo, hi)`` as consecutive segments: the pieces ``(offset, values)`` given, and the gaps (None: in the
    region)."""
    out, at = [], lo
    for offset, values in sorted(pieces, key=lambda piece: piece[0]):
        if offset > at:
            out.append((at, offset, None))
        out.append((offset, offset + values.numel(), values))
        at = offset + values.numel()
    if hi > at:
        out.append((at, hi, None))
    return out


def _split(start: int, stop: int, world: int) -> list[int]:
    """Slice boundaries of ``[start, stop)`` for ``world`` owners, as even as integers allow."""
    n = stop - start
    return [start + (n * r) // world for r in range(world + 1)]


def _reserve(path: str, size: int) -> str | None:
    """Create the segment with its pages reserved: a full /dev/shm then fails here (ENOSPC), not as a SIGBUS mid-run."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None
    os.close(fd)
    return path


__all__ = ["HostGroup", "host_identity"]
