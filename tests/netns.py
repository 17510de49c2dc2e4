"""A test cluster of hosts built from Linux network namespaces, so multi-host tests see real separate hosts.

Each host is a namespace with its own address (10.77.0.1, .2, ...), its own loopback, and one veth link to a
bridge that lives in a switch namespace of its own: nothing is added to the machine's own network, traffic goes
only between the hosts, and a host's link can be cut at the switch (``cut``) as a pulled cable would. Host names
resolve through ``/etc/netns/<ns>/hosts`` (``ip netns exec`` mounts it over ``/etc/hosts``). ``close`` removes
every namespace and file; the fixture always calls it. Needs root and a kernel that allows namespaces; where
either is missing the fixture skips with the reason.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SUBNET = "10.77.0"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    probe = f"approbe{os.getpid()}"
    res = _ip("netns", "add", probe)
    if res.returncode != 0:
        return f"the kernel refuses network namespaces: {res.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


class NetnsCluster:
    def __init__(self, hosts: int = 3, names: list[str] | None = None):
        tag = f"ap{os.getpid() % 100000}"
        self.switch = f"{tag}sw"
        self.namespaces = [f"{tag}h{k}" for k in range(hosts)]
        self.links = [f"{tag}v{k}" for k in range(hosts)]  # the switch-side end of each host's cable
        self.addresses = [f"{SUBNET}.{k + 1}" for k in range(hosts)]
        self.names = names or [f"node{k:02d}" for k in range(1, hosts + 1)]
        try:
            self._build()
        except Exception:
            self.close()
            raise

    def _run(self, *args: str) -> None:
        res = _ip(*args)
        if res.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")

    def _build(self) -> None:
        self._run("netns", "add", self.switch)
        self._run("-n", self.switch, "link", "add", "br0", "type", "bridge")
        self._run("-n", self.switch, "link", "set", "br0", "up")
        hosts = "".join(f"{a} {n}\n" for a, n in zip(self.addresses, self.names))
        for ns, link, addr in zip(self.namespaces, self.links, self.addresses):
            self._run("netns", "add", ns)
            self._run("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._run("link", "set", link, "netns", self.switch)
            self._run("-n", self.switch, "link", "set", link, "master", "br0", "up")
            self._run("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            self._run("-n", ns, "link", "set", "eth0", "up")
            self._run("-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{hosts}")

    def cmd(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run on host ``host``."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def cut(self, host: int) -> None:
        """Pull host ``host``'s cable: its packets stop, no connection is reset (as on a real network)."""
        self._run("-n", self.switch, "link", "set", self.links[host], "down")

    def restore(self, host: int) -> None:
        self._run("-n", self.switch, "link", "set", self.links[host], "up")

    def listening(self, host: int) -> list[str]:
        """Local addresses of the TCP sockets listening on host ``host`` (``ss -ltnH``)."""
        res = subprocess.run(self.cmd(host, ["ss", "-ltnH"]), capture_output=True, text=True, timeout=30)
        return [line.split()[3] for line in res.stdout.splitlines() if line.strip()]

    def close(self) -> None:
        for ns in [*self.namespaces, self.switch]:
            _ip("netns", "del", ns)  # deleting a namespace deletes its ends of the veth pairs
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
