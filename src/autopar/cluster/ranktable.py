"""MindSpore / HCCL rank table files (``RANK_TABLE_FILE``, formerly ``MINDSPORE_HCCL_CONFIG_PATH``).

MindSpore's Ascend launch scripts (``run.sh``) describe the cluster in a JSON "rank table" and start one process per
device with ``RANK_ID``, ``DEVICE_ID`` and ``RANK_SIZE``. autopar reads the same file so those scripts run unchanged
on torch.distributed: the world size, each process's rank and device, and the rendezvous address (rank 0's server)
all come from the table.

HCCL rejects an inconsistent table at init time with an opaque error, or worse, hangs. We check the same rules up
front and raise a one-line :class:`~autopar.errors.ClusterError` that names the file, the field and the value.

Two formats are read (numbers are JSON strings in both; plain ints are accepted too):

* ``r1`` (MindSpore >= 1.0): ``{"version", "server_count", "server_list": [{"server_id", "device": [{"device_id",
  "device_ip", "rank_id"}], "host_nic_ip"}], "status"}``
* ``r0.2`` (MindSpore 0.x): ``{"group_count", "group_list": [{"device_num", "server_num", "instance_count",
  "instance_list": [{"devices": [{"device_id", "device_ip"}], "rank_id", "server_id"}]}], "status", ...}``
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from autopar.errors import ClusterError

_UINT = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class RankEntry:
    """One rank = one device: its logical ``rank_id``, the host it lives on and the physical device on that host."""

    rank_id: int
    server_id: str
    device_id: int
    device_ip: str | None = None


@dataclass(frozen=True)
class RankTable:
    """A validated rank table: ``entries[i].rank_id == i`` and ranks are grouped by server in server_id order."""

    path: str
    format: Literal["r1", "r0.2"]
    servers: tuple[str, ...]  # in file order
    entries: tuple[RankEntry, ...]  # sorted by rank_id

    @property
    def world_size(self) -> int:
        return len(self.entries)

    @property
    def master_addr(self) -> str:
        """Rank 0's server_id: an IP address in MindSpore tables, so it doubles as the rendezvous host."""
        return self.entries[0].server_id

    def entry(self, rank_id: int) -> RankEntry:
        if not 0 <= rank_id < self.world_size:
            raise ClusterError(f"rank {rank_id} is not in rank table {self.path} (ranks 0..{self.world_size - 1})")
        return self.entries[rank_id]

    def ranks_on(self, server_id: str) -> tuple[int, ...]:
        """Global ranks on ``server_id``, ascending."""
        if server_id not in self.servers:
            known = ", ".join(self.servers)
            raise ClusterError(f"server {server_id!r} is not in rank table {self.path} (servers: {known})")
        return tuple(e.rank_id for e in self.entries if e.server_id == server_id)

    def local_rank(self, rank_id: int) -> int:
        """Index of ``rank_id`` among the ranks of its own server (what torch calls LOCAL_RANK)."""
        return self.ranks_on(self.entry(rank_id).server_id).index(rank_id)

    def local_size(self, rank_id: int) -> int:
        return len(self.ranks_on(self.entry(rank_id).server_id))

    def node_rank(self, server_id: str) -> int:
        """Index of the server in lexicographic server_id order, the order HCCL assigns rank blocks in."""
        self.ranks_on(server_id)  # validates the name
        return sorted(self.servers).index(server_id)


# --------------------------------------------------------------------------------------------------- parsing helpers


def _err(path: str, field: str, problem: str) -> ClusterError:
    return ClusterError(f"rank table {path}: {field}: {problem}" if field else f"rank table {path}: {problem}")


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _req(obj: dict, key: str, path: str, where: str = "") -> Any:
    if key not in obj:
        raise _err(path, _join(where, key), "required field is missing")
    return obj[key]


def _uint(value: Any, path: str, field: str) -> int:
    """MindSpore writes numbers as strings ("rank_id": "0"); hand-written tables often use ints: take both."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and _UINT.fullmatch(value.strip()):
        return int(value)
    raise _err(path, field, f"expected a non-negative integer, got {value!r}")


def _str(value: Any, path: str, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _err(path, field, f"expected a non-empty string, got {value!r}")
    return value.strip()


def _items(value: Any, path: str, field: str) -> list[dict]:
    """A non-empty list of JSON objects (servers, devices, groups, instances)."""
    if not isinstance(value, list) or not value:
        raise _err(path, field, f"expected a non-empty list, got {value!r}"[:200])
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _err(path, f"{field}[{i}]", f"expected a JSON object, got {item!r}"[:200])
    return value


def _device_ip(dev: dict, path: str, where: str) -> str | None:
    ip = dev.get("device_ip")
    if ip is not None and not isinstance(ip, str):
        raise _err(path, f"{where}.device_ip", f"expected a string, got {ip!r}")
    return ip


def _check_count(declared_raw: Any, actual: int, path: str, field: str, what: str) -> None:
    declared = _uint(declared_raw, path, field)
    if declared != actual:
        raise _err(path, field, f"says {declared} but the file lists {actual} {what}")


# Each parser returns (servers in file order, entries in file order, (rank_id field, device_id field) per entry);
# the field paths let the shared checks point at the exact place of a violation.
_Parsed = tuple[tuple[str, ...], list[RankEntry], list[tuple[str, str]]]


def _parse_r1(doc: dict, path: str) -> _Parsed:
    server_list = _items(_req(doc, "server_list", path), path, "server_list")
    entries, places, first_at = [], [], {}
    for i, server in enumerate(server_list):
        where = f"server_list[{i}]"
        sid = _str(_req(server, "server_id", path, where), path, f"{where}.server_id")
        if sid in first_at:
            also = f"server_list[{first_at[sid]}]"
            raise _err(path, f"{where}.server_id", f"server {sid!r} is listed twice (also {also})")
        first_at[sid] = i
        for j, dev in enumerate(_items(_req(server, "device", path, where), path, f"{where}.device")):
            dw = f"{where}.device[{j}]"
            rank = _uint(_req(dev, "rank_id", path, dw), path, f"{dw}.rank_id")
            device = _uint(_req(dev, "device_id", path, dw), path, f"{dw}.device_id")
            entries.append(RankEntry(rank, sid, device, _device_ip(dev, path, dw)))
            places.append((f"{dw}.rank_id", f"{dw}.device_id"))
    _check_count(_req(doc, "server_count", path), len(server_list), path, "server_count", "servers in server_list")
    return tuple(first_at), entries, places


def _parse_r02(doc: dict, path: str) -> _Parsed:
    groups = _items(_req(doc, "group_list", path), path, "group_list")
    entries, places, servers = [], [], {}
    for g, group in enumerate(groups):
        gw = f"group_list[{g}]"
        instances = _items(_req(group, "instance_list", path, gw), path, f"{gw}.instance_list")
        group_servers = {}
        for i, inst in enumerate(instances):
            iw = f"{gw}.instance_list[{i}]"
            sid = _str(_req(inst, "server_id", path, iw), path, f"{iw}.server_id")
            rank = _uint(_req(inst, "rank_id", path, iw), path, f"{iw}.rank_id")
            devices = _items(_req(inst, "devices", path, iw), path, f"{iw}.devices")
            if len(devices) != 1:  # an instance is one rank, and a rank drives exactly one device
                raise _err(path, f"{iw}.devices", f"expected exactly one device per instance, got {len(devices)}")
            dw = f"{iw}.devices[0]"
            device = _uint(_req(devices[0], "device_id", path, dw), path, f"{dw}.device_id")
            entries.append(RankEntry(rank, sid, device, _device_ip(devices[0], path, dw)))
            places.append((f"{iw}.rank_id", f"{dw}.device_id"))
            servers.setdefault(sid, None)
            group_servers.setdefault(sid, None)
        for key, actual, what in (("instance_count", len(instances), "instances"),
                                  ("device_num", len(instances), "devices"),
                                  ("server_num", len(group_servers), "distinct server_id values")):
            _check_count(_req(group, key, path, gw), actual, path, f"{gw}.{key}", what)
    _check_count(_req(doc, "group_count", path), len(groups), path, "group_count", "groups in group_list")
    return tuple(servers), entries, places


def _ids(ids: list[int]) -> str:
    shown = ", ".join(map(str, ids[:10]))
    return f"[{shown}{', ...' if len(ids) > 10 else ''}]"


def _span(ranks: list[int]) -> str:
    return f"{min(ranks)}..{max(ranks)}"


def _validate(path: str, entries: list[RankEntry], places: list[tuple[str, str]]) -> None:
    """The rules HCCL enforces on every format: ranks 0..N-1, unique devices per host, rank blocks by server_id."""
    rank_at: dict[int, str] = {}
    for e, (rank_field, _) in zip(entries, places):
        if e.rank_id in rank_at:
            raise _err(path, rank_field, f"rank_id {e.rank_id} is used twice (also at {rank_at[e.rank_id]})")
        rank_at[e.rank_id] = rank_field
    n = len(entries)
    missing = sorted(set(range(n)) - rank_at.keys())
    if missing:  # ranks are unique, so some rank is >= n exactly when some id below n is missing
        extra = sorted(rank_at.keys() - set(range(n)))
        raise _err(path, rank_at[extra[0]], f"rank ids must be exactly 0..{n - 1} for {n} devices: "
                   f"missing {_ids(missing)}, unexpected {_ids(extra)}")

    device_at: dict[tuple[str, int], str] = {}
    for e, (_, device_field) in zip(entries, places):
        key = (e.server_id, e.device_id)
        if key in device_at:
            raise _err(path, device_field, f"device_id {e.device_id} is used twice on server {e.server_id!r} "
                       f"(also at {device_at[key]})")
        device_at[key] = device_field

    # HCCL hands out rank blocks in the *string* order of server_id ("10.0.0.10" sorts before "10.0.0.9").
    # Checking neighbours suffices: max(a) < min(b) <= max(b) < min(c) chains across the sorted list.
    ranks: dict[str, list[int]] = {}
    for e in entries:
        ranks.setdefault(e.server_id, []).append(e.rank_id)
    ordered = sorted(ranks)
    for lo, hi in zip(ordered, ordered[1:]):
        if max(ranks[lo]) > min(ranks[hi]):
            raise _err(path, "rank_id", f"rank order must follow the lexicographic order of server_id: server {lo!r} "
                       f"(ranks {_span(ranks[lo])}) sorts before server {hi!r} (ranks {_span(ranks[hi])}) "
                       f"yet holds rank {max(ranks[lo])} > rank {min(ranks[hi])}")


def load_rank_table(path: str | os.PathLike) -> RankTable:
    """Read, detect the format of (``server_list`` -> r1, ``group_list`` -> r0.2) and validate a rank table."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise _err(path, "", "file not found") from None
    except UnicodeDecodeError as exc:
        raise _err(path, "", f"not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise _err(path, "", f"cannot read: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _err(path, "", f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(doc, dict):
        raise _err(path, "", f"expected a JSON object at the top level, got {type(doc).__name__}")

    if "server_list" in doc:
        fmt, parse = "r1", _parse_r1
    elif "group_list" in doc:
        fmt, parse = "r0.2", _parse_r02
    else:
        raise _err(path, "", "neither 'server_list' (r1 format) nor 'group_list' (r0.2 format) is present")
    status = _req(doc, "status", path)
    if status != "completed":  # MindSpore refuses tables that are still being generated
        raise _err(path, "status", f"must be 'completed', got {status!r}")

    servers, entries, places = parse(doc, path)
    _validate(path, entries, places)
    return RankTable(path, fmt, servers, tuple(sorted(entries, key=lambda e: e.rank_id)))


def _env_uint(env: Mapping[str, str], name: str, context: str) -> int:
    raw = env[name]
    if not _UINT.fullmatch(raw.strip()):
        raise ClusterError(f"{name}={raw!r} is not a non-negative integer ({context})")
    return int(raw)


def rank_from_env(env: Mapping[str, str] | None = None) -> tuple[RankTable, int] | None:
    """This process's rank table and rank, as set up by MindSpore's ``run.sh``; None when no table is configured.

    ``env`` defaults to ``os.environ``. ``RANK_TABLE_FILE`` wins over the 0.x name ``MINDSPORE_HCCL_CONFIG_PATH``;
    empty variables count as unset. ``RANK_SIZE`` and ``DEVICE_ID`` are optional but, when set, must agree with the
    table: a mismatch means the script and the table describe different clusters. Without ``RANK_ID`` the rank is the
    table's entry for ``DEVICE_ID`` on this host, as MindSpore 0.x took it (r0.2's ``run.sh`` sets no ``RANK_ID``).
    """
    env = os.environ if env is None else env
    var = next((v for v in ("RANK_TABLE_FILE", "MINDSPORE_HCCL_CONFIG_PATH") if env.get(v)), None)
    if var is None:
        return None
    table = load_rank_table(env[var])
    n, where = table.world_size, f"rank table {table.path} has ranks 0..{table.world_size - 1}"

    if not env.get("RANK_ID", "").strip():
        return table, _rank_of_device(table, env, var)
    rank = _env_uint(env, "RANK_ID", where)
    if rank >= n:
        raise ClusterError(f"RANK_ID={rank} is out of range: {where}")

    if env.get("RANK_SIZE", "").strip():
        size = _env_uint(env, "RANK_SIZE", f"rank table {table.path} has {n} ranks")
        if size != n:
            raise ClusterError(f"RANK_SIZE={size} does not match rank table {table.path}, which has {n} ranks")

    if env.get("DEVICE_ID", "").strip():
        entry = table.entry(rank)
        device = _env_uint(env, "DEVICE_ID", f"rank {rank} is device_id {entry.device_id} in {table.path}")
        if device != entry.device_id:
            raise ClusterError(f"DEVICE_ID={device} does not match rank table {table.path}: rank {rank} is "
                               f"device_id {entry.device_id} on server {entry.server_id!r}")
    return table, rank


def _rank_of_device(table: RankTable, env: Mapping[str, str], var: str) -> int:
    """The rank of ``DEVICE_ID`` on this host, for a process started without ``RANK_ID``: the one entry with that
    device, or among several servers' the one whose server_id is an address of this host (HCCL's choice)."""
    unset = f"{var}={table.path} is set but RANK_ID is not"
    if not env.get("DEVICE_ID", "").strip():
        raise ClusterError(f"{unset}, nor DEVICE_ID: set RANK_ID to this process's rank (0..{table.world_size - 1}) "
                           f"or DEVICE_ID to its device")
    device = _env_uint(env, "DEVICE_ID", f"{unset}; the rank is taken from DEVICE_ID's entry")
    matches = [e for e in table.entries if e.device_id == device]
    if len(matches) > 1:
        from autopar.cluster.netutil import local_addresses

        mine = set(local_addresses())
        matches = [e for e in matches if e.server_id in mine] or matches
    if len(matches) == 1:
        return matches[0].rank_id
    if not matches:
        raise ClusterError(f"{unset}, and DEVICE_ID={device} is no device of the table (devices "
                           f"{_ids(sorted({e.device_id for e in table.entries}))}): set RANK_ID or DEVICE_ID")
    servers = ", ".join(e.server_id for e in matches)
    raise ClusterError(f"{unset}, and DEVICE_ID={device} is on servers {servers}, none of them an address of this "
                       f"host: set RANK_ID to this process's rank")
