"""A memory cap per rank for the benchmarks: each worker process moves itself into a memory cgroup of its own (a
child of the cgroup it runs in, cgroup v1 or v2) whose limit is what one rank may use, so a rank that needs more is
killed by the kernel (no swap on these hosts) -- "starts and trains within N bytes a rank", checked by the kernel
rather than read off a peak. Needs write access to the cgroup file system (root here); elsewhere the worker says so
and runs uncapped. The driver removes the cgroups after the job (:func:`remove`)."""
from __future__ import annotations

import os
from pathlib import Path

PREFIX = "autopar-bench-rank-"
ENV = "BENCH_RANK_MEMORY_BYTES"


def _own_memory_cgroup() -> tuple[Path, str] | None:
    """This process's memory cgroup directory and the name of its limit file."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes"
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            return Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max"
    return None


def join_capped() -> str | None:
    """Cap this process at ``$BENCH_RANK_MEMORY_BYTES`` (call it before importing torch, so the interpreter's own
    memory counts); the cgroup's path, or None (no cap asked for, or none could be set: said on stderr)."""
    limit = os.environ.get(ENV)
    if not limit:
        return None
    own = _own_memory_cgroup()
    try:
        if own is None:
            raise OSError("no memory cgroup")
        group = own[0] / f"{PREFIX}{os.getpid()}"
        group.mkdir()
        (group / own[1]).write_text(limit)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        print(f"[bench] could not cap this rank's memory at {limit} bytes ({exc}); running uncapped", flush=True)
        return None
    return str(group)


def remove() -> None:
    """Remove the (now empty) cgroups the workers made."""
    own = _own_memory_cgroup()
    if own is None or not own[0].is_dir():
        return
    for group in own[0].glob(PREFIX + "*"):
        try:
            group.rmdir()
        except OSError:
            pass  # a worker still in it (the job is still being torn down): left for the next call
