"""Where the planner keeps what it measured (``AUTOPAR_CACHE_DIR``, default ``~/.cache/autopar``), written so that a
reader never sees half a file."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("AUTOPAR_CACHE_DIR") or Path.home() / ".cache" / "autopar")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
