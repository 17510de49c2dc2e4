"""The rendezvous protocol between the MindSpore-style scheduler and its workers, over torch's TCPStore.

Everything is a key in the scheduler's ``TCPStore`` (no home-made transport):

- ``job``              scheduler -> all: ``{"world_size": N}``
- ``req_count``        counter; a worker's ``add(req_count, 1)`` gives it a unique request number n
- ``req/<n>``          worker -> scheduler: who it is (host, pid, MS_NODE_ID, rank hint, MS_WORKER_NUM, auth)
- ``resp/<n>``         scheduler -> worker: ``{"rank": r}`` or ``{"error": "..."}``
- ``joined``           number of workers admitted so far (for "only k of N joined" messages)
- ``admitted/<r>``     written when rank r is admitted (the launcher tells a worker that never joined from one that
                       finished)
- ``ready``            written once all N are admitted: ``{"hosts": [host id of rank 0, 1, ...]}``
- ``hb/<r>``           heartbeat counter of rank r (the scheduler declares silence a death)
- ``done/<r>``         ``{"status": "ok" | "failed" | "aborted", "detail": ...}`` written as rank r exits
- ``abort``            the reason, once any rank failed: every other worker stops
- ``pg/...``           the torch.distributed process group's own rendezvous keys

Requests are decided by the scheduler alone, so duplicate registrations, extra workers and wrong job tokens are
refused with a message to the offending process, which never obtains a rank.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import json
from typing import Any

PREFIX = "autopar/"
JOB = PREFIX + "job"
REQ_COUNT = PREFIX + "req_count"
JOINED = PREFIX + "joined"
READY = PREFIX + "ready"
ABORT = PREFIX + "abort"
PG_PREFIX = PREFIX + "pg/"

# Exit code of a worker stopped because another member of the job failed (not the root cause).
EXIT_ABORTED = 86
HEARTBEAT_INTERVAL = 1.0


def req_key(n: int) -> str:
    return f"{PREFIX}req/{n}"


def resp_key(n: int) -> str:
    return f"{PREFIX}resp/{n}"


def admitted_key(rank: int) -> str:
    return f"{PREFIX}admitted/{rank}"


def hb_key(rank: int) -> str:
    return f"{PREFIX}hb/{rank}"


def done_key(rank: int) -> str:
    return f"{PREFIX}done/{rank}"


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)


def loads(raw: bytes | str) -> Any:
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def auth_code(token: str | None, n: int) -> str | None:
    """HMAC of the request number under the job token: the token itself never travels over the store."""
    if not token:
        return None
    return hmac.new(token.encode(), f"autopar-join-{n}".encode(), hashlib.sha256).hexdigest()


def auth_ok(token: str | None, n: int, code: str | None) -> bool:
    if not token:
        return True
    return code is not None and hmac.compare_digest(auth_code(token, n) or "", code)


STORE_OP_TIMEOUT_S = 5.0  # a worker's store calls give up after this long (so a lost scheduler is noticed)


def seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


def first_line(exc: BaseException) -> str:
    """torch's C++ errors carry a stack dump after the first line; users need only the first."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
