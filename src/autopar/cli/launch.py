"""``autopar launch -n N [--log-dir DIR] [--port P] script.py [args...]``"""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="start a scheduler and N workers on this host (MindSpore dynamic-cluster contract)",
        description="Start the scheduler and N worker processes of SCRIPT on this host, as a MindSpore run.sh "
        "would (MS_ROLE/MS_WORKER_NUM/MS_SCHED_HOST/MS_SCHED_PORT), write per-rank logs, stream rank 0, "
        "and stop every process if one fails.",
    )
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of worker processes")
    p.add_argument("--log-dir", default="autopar_logs", help="directory for scheduler.log, worker_I.log, env_I.log")
    p.add_argument("--port", type=int, default=None, help="scheduler port (default: a free port)")
    p.add_argument("--host", default="127.0.0.1", help="address the scheduler listens on (default 127.0.0.1)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autopar.cluster.launcher import LaunchConfig, launch

    return launch(
        LaunchConfig(
            nproc=args.nproc,
            script=args.script,
            script_args=list(args.script_args),
            log_dir=args.log_dir,
            port=args.port,
            host=args.host,
        )
    )
