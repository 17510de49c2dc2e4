"""Atomic writes: a checkpoint either exists under its final name complete, or not at all.

Everything is written under a temporary name (``<name>.tmp-<pid>``), flushed and fsync'ed, then renamed into place
and the parent directory fsync'ed. A process killed while saving leaves only a ``.tmp-`` entry, which no reader
treats as a checkpoint (and which the next save in that directory removes); the previous checkpoint is untouched.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from autopar.cluster.processes import process_alive

TMP_MARK = ".tmp-"


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(root))


def _tmp(target: Path) -> Path:
    return target.with_name(f"{target.name}{TMP_MARK}{os.getpid()}")


@contextlib.contextmanager
def atomic_file(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it becomes ``target`` atomically."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp(target)
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory to fill; on success it is renamed to ``target`` (replacing an older one)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp(target)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temporaries(directory: Path, prefix: str) -> None:
    """Leftovers of saves killed half-way (only ones of dead processes: a live writer may still be at work)."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if not entry.name.startswith(prefix) or TMP_MARK not in entry.name:
            continue
        pid = entry.name.rsplit(TMP_MARK, 1)[1]
        if pid.isdigit() and process_alive(int(pid)) and int(pid) != os.getpid():
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
