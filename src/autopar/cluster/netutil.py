"""Listening sockets for the scheduler: bound by us, so we choose the interface and report clear errors."""
from __future__ import annotations

import errno
import socket

from autopar.errors import ClusterError


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0 = any free port).

    torch's TCPStore would bind every interface; handing it this socket (``master_listen_fd``) keeps a scheduler
    configured for 127.0.0.1 unreachable from other hosts, and lets a launcher reserve the port race-free.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ClusterError(f"cannot resolve scheduler host {host!r}: {exc.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ClusterError(f"port {port} on {host} is already in use; choose another port") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ClusterError(f"{host} is not an address of this machine; the scheduler cannot listen on it") from None
        raise ClusterError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for tests and launchers that cannot pass a socket)."""
    with bind_listener(host, 0) as sock:
        return sock.getsockname()[1]
