"""Listening sockets for the scheduler: bound by us, so we choose the interface and report clear errors."""
from __future__ import annotations

import errno
import ipaddress
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


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    """Does something accept TCP connections on ``host:port``? A plain socket, so that waiting for a scheduler
    that is not (or no longer) there costs no c10d connection attempt -- each of which logs a C++ stack dump."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_refused(host: str, port: int, timeout: float = 1.0) -> bool:
    """True only when ``host`` answers that nothing listens on ``port`` (a refused connection): the process that
    listened there is gone. A timeout proves nothing (a slow or silent network) and gives False."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def local_addresses() -> dict[str, str]:
    """This host's IP addresses (any interface, loopback included), each with its interface's name."""
    import psutil

    return {a.address.split("%")[0]: name for name, addrs in psutil.net_if_addrs().items() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}


def _resolve(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as exc:
        raise ClusterError(f"cannot resolve {host!r}: {exc.strerror}") from None


def interface_towards(host: str) -> tuple[str, str] | None:
    """(interface name, local address) through which this host reaches ``host``; None for a loopback address or
    when the kernel has no route to it.

    Why: gloo advertises the address its host name resolves to, and on many machines (and in containers) that is
    127.0.1.1 or 127.0.0.1 -- fine on one host, unreachable from any other, so a multi-host job dies in
    ``connectFullMesh``. The interface that routes to the rendezvous host is the one the peers can reach.
    """
    ip = _resolve(host)
    if ipaddress.ip_address(ip).is_loopback:
        return None
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:  # connect() on UDP sends nothing: it asks the routing table
        try:
            probe.connect((ip, 9))
        except OSError:
            return None
        local = probe.getsockname()[0]
    name = local_addresses().get(local)
    return (name, local) if name else None
