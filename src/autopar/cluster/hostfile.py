"""mpirun / DeepSpeed hostfiles: ``hostname slots=N`` per line.

For GPU-style multi-node launches (``mpirun --hostfile``, ``deepspeed --hostfile``) the hostfile *is* the cluster
description: the line order gives each host's node rank and ``slots`` its number of processes. Global ranks are
handed out host by host, the layout of mpirun's default ``--map-by slot`` and of DeepSpeed's launcher, so
:func:`rank_range` matches what those launchers would assign.

Accepted syntax: ``host``, ``host slots=N`` (``max_slots=``/``max-slots=`` are accepted and ignored), ``#``
comments anywhere on a line, blank lines, any whitespace.
"""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Sequence

from autopar.errors import ClusterError

_UINT = re.compile(r"[0-9]+")
_IGNORED = ("max_slots", "max-slots")


@dataclass(frozen=True)
class HostSlots:
    host: str
    slots: int


def _host_key(host: str) -> str:
    """Compare hosts the way the network does: IPs by value ("::1" == "0::1"), names case-insensitively."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower().rstrip(".")


def _parse_line(line: str, where: str) -> HostSlots:
    host, *options = line.split()
    if "=" in host:
        raise ClusterError(f"{where}: expected a host name first, got {host!r} (syntax: 'hostname [slots=N]')")
    slots, seen = 1, set()
    for opt in options:
        key, sep, value = opt.partition("=")
        if not sep or key not in ("slots", *_IGNORED):
            raise ClusterError(f"{where}: unexpected {opt!r} after host {host!r} (syntax: 'hostname [slots=N]')")
        if key in seen:
            raise ClusterError(f"{where}: {key}= is given twice for host {host!r}")
        seen.add(key)
        if key == "slots":
            if not _UINT.fullmatch(value) or int(value) == 0:
                raise ClusterError(f"{where}: slots must be a positive integer, got {value!r} for host {host!r}")
            slots = int(value)
    return HostSlots(host, slots)


def load_hostfile(path: str | os.PathLike) -> tuple[HostSlots, ...]:
    """Hosts in file order; a duplicate host is an error since it would silently give one node two node ranks."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ClusterError(f"hostfile {path}: file not found") from None
    except UnicodeDecodeError as exc:
        raise ClusterError(f"hostfile {path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ClusterError(f"hostfile {path}: cannot read: {exc.strerror or exc}") from None

    hosts: list[HostSlots] = []
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        entry = _parse_line(line, f"hostfile {path}:{lineno}")
        key = _host_key(entry.host)
        if key in first_line:
            raise ClusterError(f"hostfile {path}:{lineno}: host {entry.host!r} is listed twice "
                               f"(first on line {first_line[key]})")
        first_line[key] = lineno
        hosts.append(entry)
    if not hosts:
        raise ClusterError(f"hostfile {path}: no hosts (the file is empty or only has comments)")
    return tuple(hosts)


def world_size(hosts: Sequence[HostSlots]) -> int:
    """Total number of processes: one per slot."""
    return sum(h.slots for h in hosts)


def rank_range(hosts: Sequence[HostSlots], node_rank: int) -> range:
    """Global ranks of the ``node_rank``-th host: the slots of all earlier hosts come first."""
    if not 0 <= node_rank < len(hosts):
        raise ClusterError(f"node rank {node_rank} is out of range for a hostfile of {len(hosts)} hosts "
                           f"(0..{len(hosts) - 1})")
    start = world_size(hosts[:node_rank])
    return range(start, start + hosts[node_rank].slots)


def node_rank_of(hosts: Sequence[HostSlots], hostname_or_ip: str) -> int:
    """Line index of a host (IP compared by value, name case-insensitively); no DNS lookup, so no hidden latency."""
    key = _host_key(hostname_or_ip)
    for i, h in enumerate(hosts):
        if _host_key(h.host) == key:
            return i
    raise ClusterError(f"host {hostname_or_ip!r} is not in the hostfile (hosts: {', '.join(h.host for h in hosts)})")
