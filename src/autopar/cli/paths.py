"""Output paths of the commands, checked before the work: a path that cannot be written is one line, at once."""
from __future__ import annotations

import os
from pathlib import Path

from autopar.errors import ConfigError


def writable_parent(path: str, flag: str) -> Path:
    """Create ``path``'s directory if missing (as the checkpoint writers do); a one-line error when it cannot be
    (a file in the way, no permission) or when ``path`` is a directory itself."""
    target = Path(path).expanduser()
    parent = target.resolve().parent
    if target.is_dir():
        raise ConfigError(f"{flag} {path} is a directory: give a file name")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"{flag} {path}: a file is in the way of its directory {parent}") from None
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot create {parent}: {exc.strerror}") from None
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: {parent} is not writable")
    return target
