"""Whether a process on this host is still running (for the checks that decide another process is gone)."""
from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs; a process that exited but was not reaped yet (a zombie) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True
