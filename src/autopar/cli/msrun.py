"""``msrun``: MindSpore 2.3+'s launcher, as an alias of ``autopar launch`` with MindSpore's flag names.

    msrun --worker_num=N --local_worker_num=M --master_addr=A --master_port=P --node_rank=K --log_dir=D \\
          --join=True|False --cluster_time_out=S script.py [args...]

The flags are parsed into the same :class:`~autopar.cluster.launcher.LaunchConfig` that ``autopar launch`` builds
(one implementation): the scheduler listens on ``--master_addr:--master_port`` (MindSpore's defaults 127.0.0.1 and
8118), this node runs ``--local_worker_num`` workers, ranks are numbered node by node, and the logs are MindSpore's
(``LOG_DIR/scheduler.log``, ``LOG_DIR/worker_<rank>.log``; the current directory by default). ``--join=False``
(MindSpore's default) returns at once and leaves the job running in the background, ``--join=True`` waits and
returns the job's exit code. ``--cluster_time_out`` is ``AUTOPAR_CLUSTER_TIMEOUT`` (negative: wait forever).
Across nodes, export the same ``AUTOPAR_JOB_TOKEN`` on every node (node 0 prints one when it is unset): msrun has
no flag for autopar's job token. Flags autopar cannot honour warn (``--bind_core``, ``--rank_table_file``).

``--sim_level=0|1`` is MindSpore's DryRun, as ``autopar launch --dry-run``: the script runs on this CPU as rank
``--sim_rank_id`` (default 0) of ``--worker_num`` simulated ranks, nothing is launched. Level 0 checks the
configuration (one line at the first error); level 1 also reports the rank's peak memory and its parts (both write
``LOG_DIR/dryrun.json``). MindSpore's levels 2 and 3 (kernels launched on an Ascend device) are a one-line error.
"""
from __future__ import annotations

import argparse
import ast
import os
import secrets
import sys

from autopar.cli.main import guarded
from autopar.errors import AutoparError, ConfigError

FOREVER = 10**8  # seconds: "wait infinitely" (a negative --cluster_time_out) in a form every timeout accepts


def _bool(text: str) -> bool:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = None
    if not isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="msrun", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker_num", type=int, default=8, help="workers of the whole job (default 8)")
    p.add_argument("--local_worker_num", type=int, default=8, help="workers on this node (default 8)")
    p.add_argument("--master_addr", default="127.0.0.1", help="the scheduler's address (default 127.0.0.1)")
    p.add_argument("--master_port", type=int, default=8118, help="the scheduler's port, 1024-65535 (default 8118)")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's index (ignored on one node)")
    p.add_argument("--log_dir", default="", help="scheduler.log and worker_<rank>.log go here (default: .)")
    p.add_argument("--join", type=_bool, default=False, help="True: wait for the job and return its exit code")
    p.add_argument("--cluster_time_out", type=int, default=600,
                   help="seconds for the cluster to form (default 600; negative: wait forever)")
    p.add_argument("--bind_core", type=_bool, default=False, help="accepted, not applied (warns)")
    p.add_argument("--sim_level", type=int, default=-1,
                   help="dry run on this CPU: 0 checks the configuration, 1 also reports peak memory")
    p.add_argument("--sim_rank_id", type=int, default=-1, help="the rank a dry run simulates (default 0)")
    p.add_argument("--rank_table_file", default="", help="accepted, not used (warns)")
    p.add_argument("task_script", help="the training script")
    p.add_argument("task_script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _warn(message: str) -> None:
    print(f"msrun: warning: {message}", file=sys.stderr, flush=True)


def to_config(args: argparse.Namespace):
    """msrun's flags -> the launcher's configuration (one-line errors for what cannot be honoured)."""
    from autopar.cluster.launcher import LaunchConfig

    if args.sim_level not in (-1, 0, 1):
        raise ConfigError(f"--sim_level={args.sim_level}: autopar simulates levels 0 (configuration) and 1 (with "
                          "peak memory); levels 2 and 3 launch kernels on an Ascend device")
    if args.worker_num < 1 or args.local_worker_num < 1:
        raise ConfigError(f"--worker_num and --local_worker_num must be positive, got {args.worker_num} and "
                          f"{args.local_worker_num}")
    if args.local_worker_num > args.worker_num:
        raise ConfigError(f"--local_worker_num={args.local_worker_num} is more than --worker_num={args.worker_num}")
    if args.worker_num % args.local_worker_num:
        raise ConfigError(f"--worker_num={args.worker_num} is not a multiple of --local_worker_num="
                          f"{args.local_worker_num}: autopar numbers ranks node by node, the same count on each")
    if not 1024 <= args.master_port <= 65535:
        raise ConfigError(f"--master_port={args.master_port} is not in 1024..65535")
    if args.bind_core:
        _warn("--bind_core=True is accepted but not applied: workers share the cores (OMP_NUM_THREADS splits them)")
    if args.rank_table_file:
        _warn(f"--rank_table_file={args.rank_table_file} is not used (msrun itself forms the cluster)")
    if args.sim_rank_id != -1:
        _warn("--sim_rank_id is ignored without --sim_level")
    nnodes = args.worker_num // args.local_worker_num
    token = os.environ.get("AUTOPAR_JOB_TOKEN") or None
    if nnodes > 1:
        if args.node_rank < 0:
            raise ConfigError(f"{nnodes} nodes: give --node_rank (autopar numbers the ranks node by node)")
        if not 0 <= args.node_rank < nnodes:
            raise ConfigError(f"--node_rank={args.node_rank} is outside 0..{nnodes - 1}")
        if token is None:
            if args.node_rank > 0:
                raise ConfigError("this node joins node 0's job: export the AUTOPAR_JOB_TOKEN node 0 printed")
            token = secrets.token_hex(16)
            print(f"[msrun] job token: export AUTOPAR_JOB_TOKEN={token} on the other nodes", flush=True)
    timeout = args.cluster_time_out if args.cluster_time_out > 0 else FOREVER
    return LaunchConfig(
        nproc=args.local_worker_num, script=args.task_script, script_args=list(args.task_script_args),
        log_dir=args.log_dir or ".", port=args.master_port, host=args.master_addr,
        nnodes=nnodes, node_rank=args.node_rank if nnodes > 1 else None,
        master_addr=args.master_addr if nnodes > 1 else None, master_port=args.master_port if nnodes > 1 else None,
        token=token, extra_env={"AUTOPAR_CLUSTER_TIMEOUT": str(timeout)},
        stream_ranks=[0] if args.join else [],
    )


def _simulate(args: argparse.Namespace) -> int:
    """``--sim_level=0|1``: MindSpore's DryRun, on autopar's (``autopar launch --dry-run``)."""
    from autopar.dryrun.driver import dry_run

    if args.worker_num < 1:
        raise ConfigError(f"--worker_num must be positive, got {args.worker_num}")
    ranks = [args.sim_rank_id] if args.sim_rank_id != -1 else None
    return dry_run(args.worker_num, args.task_script, list(args.task_script_args), args.log_dir or ".", ranks,
                   steps=1 if args.sim_level == 0 else 2, memory=args.sim_level == 1,
                   local_size=min(args.local_worker_num, args.worker_num))


def _in_background(launcher) -> int:
    """``--join=False``: the launcher goes on in a process of its own (its own session, output in
    ``LOG_DIR/msrun.log``); msrun returns at once."""
    from autopar.cluster.launcher import prepare_log_dir

    log = str(prepare_log_dir(launcher.cfg.log_dir))
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        print(f"[msrun] the job runs in the background (launcher pid {pid}); logs in {os.path.abspath(log)} "
              f"(msrun.log, scheduler.log, worker_<rank>.log); --join=True waits for it", flush=True)
        return 0
    code = 1
    try:  # pragma: no cover - the background launcher; coverage does not follow forks
        os.setsid()
        fd = os.open(os.path.join(log, "msrun.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        code = launcher.run()
        print(f"[msrun] job finished: exit {code}", flush=True)
    except AutoparError as exc:
        print(f"msrun: error: {exc}", file=sys.stderr, flush=True)
        code = 2
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def run() -> int:
        from autopar.cluster.launcher import Launcher

        if args.sim_level in (0, 1):
            return _simulate(args)
        launcher = Launcher(to_config(args))
        return launcher.run() if args.join else _in_background(launcher)

    return guarded("msrun", run)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
