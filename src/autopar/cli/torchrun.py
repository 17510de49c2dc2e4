"""torchrun's launch flags on ``autopar launch``, so that a torchrun command line works with the name swapped.

The flags that say the same as autopar's (``--nproc-per-node``, ``--node-rank``, ``--master-addr``,
``--master-port``, ``--max-restarts``, ``--log-dir``, ``--local-ranks-filter``) are aliases of autopar's own
options (:mod:`autopar.cli.launch`). This module holds the rest: the rendezvous flags, mapped onto autopar's
scheduler (``--rdzv-endpoint`` is the master's address and port, ``--rdzv-id`` the job token every node gives,
``--rdzv-conf join_timeout=S`` the cluster timeout), ``--standalone``, and the flags autopar does not take, each
refused or warned about in one line that gives the autopar spelling -- none is accepted and silently dropped.
"""
from __future__ import annotations

import argparse
import sys

from autopar.errors import ConfigError

# torchrun flags whose behaviour autopar has anyway, or which change nothing here: accepted with a warning saying so
_HARMLESS = {
    "tee": "autopar writes every rank's stdout and stderr to LOG_DIR/worker_<rank>.log and shows them on the console",
    "redirects": "autopar writes every rank's stdout and stderr to LOG_DIR/worker_<rank>.log",
    "monitor_interval": "autopar watches its workers every 0.1 s",
    "start_method": "autopar starts each worker as a fresh process (spawn)",
    "role": "autopar's workers all have the role MS_WORKER",
    "local_addr": "each node is found by its address towards --master-addr",
    "run_path": "autopar runs the script by its path",
}
# torchrun flags that would change what runs: refused, with what to write instead
_REFUSED = {
    "module": "autopar launch runs a script file: give the module's file path (python -c 'import M; print(M.__file__)')",
    "no_python": "autopar launch runs a Python script with this interpreter: give the script's path",
}
_BACKENDS = ("c10d", "static")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("torchrun's flags (the same job as autopar's own options)")
    g.add_argument("--standalone", action="store_true", help="one node, a free port (what -n alone does)")
    g.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST:PORT",
                   help="node 0's address and port (= --master-addr/--master-port)")
    g.add_argument("--rdzv-id", "--rdzv_id", default=None, metavar="ID",
                   help="the job's id, the same on every node (= --token)")
    g.add_argument("--rdzv-backend", "--rdzv_backend", default=None, metavar="c10d|static",
                   help="accepted: autopar's scheduler is the rendezvous")
    g.add_argument("--rdzv-conf", "--rdzv_conf", default=None, metavar="K=V,...",
                   help="join_timeout=S (= --cluster-timeout); other keys warn")
    for name in (*_HARMLESS, *_REFUSED):
        flags = [f"--{name.replace('_', '-')}", f"--{name}"]
        if name == "module":
            flags.insert(0, "-m")
        if name in ("tee", "redirects"):
            flags.insert(0, {"tee": "-t", "redirects": "-r"}[name])
        kwargs = {"action": "store_true"} if name in ("module", "no_python", "run_path") else {"default": None}
        g.add_argument(*dict.fromkeys(flags), dest=f"torchrun_{name}", help=argparse.SUPPRESS, **kwargs)


def apply(args: argparse.Namespace) -> None:
    """Map the torchrun flags given onto autopar's options in ``args``; refuse or warn for the others."""
    for name, why in _REFUSED.items():
        if getattr(args, f"torchrun_{name}", None):
            raise ConfigError(f"--{name.replace('_', '-')} (torchrun's) is not supported: {why}")
    for name, how in _HARMLESS.items():
        if getattr(args, f"torchrun_{name}", None) not in (None, False):
            warn(f"--{name.replace('_', '-')} (torchrun's) is ignored: {how}")
    if args.standalone and args.nnodes > 1:
        raise ConfigError(f"--standalone is one node, but --nnodes is {args.nnodes}: give one of them")
    if args.rdzv_backend is not None and args.rdzv_backend not in _BACKENDS:
        raise ConfigError(f"--rdzv-backend {args.rdzv_backend} is not supported: autopar's own scheduler is the "
                          f"rendezvous (give --rdzv-endpoint HOST:PORT, or --master-addr/--master-port)")
    if args.rdzv_endpoint:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--rdzv-endpoint {args.rdzv_endpoint!r} is not HOST:PORT (e.g. 10.0.0.1:29500)")
        args.master_addr = args.master_addr or host.strip("[]")
        args.master_port = args.master_port or int(port)
    if args.rdzv_id and not args.token:
        args.token = args.rdzv_id
    for item in filter(None, (args.rdzv_conf or "").split(",")):
        key, _, value = item.partition("=")
        if key.strip() == "join_timeout" and args.cluster_timeout is None:
            try:
                args.cluster_timeout = float(value)
            except ValueError:
                raise ConfigError(f"--rdzv-conf join_timeout={value!r} is not a number of seconds") from None
        elif key.strip() != "join_timeout":
            warn(f"--rdzv-conf {key.strip()} is ignored (only join_timeout acts: --cluster-timeout)")


def warn(message: str) -> None:
    """A flag that changes nothing: one line on stderr, before the job starts (no Python warning's source line)."""
    print(f"autopar launch: warning: {message}", file=sys.stderr, flush=True)
