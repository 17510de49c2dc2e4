"""``autopar launch -n N [options] script.py [args...]``"""
from __future__ import annotations

import argparse
import os

from autopar.cli import torchrun
from autopar.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="start a job's processes on this host (MindSpore dynamic cluster, several hosts, or a rank table)",
        description="Start this host's processes of a job and supervise them: a scheduler and N workers "
        "(MS_ROLE/MS_WORKER_NUM/MS_SCHED_HOST/MS_SCHED_PORT, as a MindSpore run.sh), this node's workers of a "
        "multi-node job, or one process per device of a rank table's server. Per-rank logs, every rank's lines on "
        "the console, every process stopped if one fails. torchrun's launch flags are accepted too.",
    )
    p.add_argument("-n", "--nproc", "--nproc-per-node", "--nproc_per_node", type=_nproc, default=1, metavar="N",
                   help="worker processes on this host (default 1; torchrun's 'auto'/'cpu': one per core)")
    p.add_argument("--log-dir", "--log_dir", default="autopar_logs",
                   help="directory for scheduler.log, worker_I.log, env_I.log")
    p.add_argument("--console-ranks", "--local-ranks-filter", "--local_ranks_filter", default=None, metavar="R,R,...",
                   help="the ranks whose output the console shows (default: every rank, each line prefixed "
                        "'[rank N]'); every rank's log is written either way")
    p.add_argument("--port", type=int, default=None, help="scheduler port on one node (default: a free port)")
    p.add_argument("--host", default="127.0.0.1", help="address the one-node scheduler listens on")
    multi = p.add_argument_group("several hosts")
    multi.add_argument("--nnodes", type=_nnodes, default=1, help="number of hosts")
    multi.add_argument("--node-rank", "--node_rank", type=int, default=None,
                       help="this host's index (0 runs the scheduler)")
    multi.add_argument("--master-addr", "--master_addr", default=None,
                       help="address of node 0's scheduler (it listens there)")
    multi.add_argument("--master-port", "--master_port", type=int, default=None, help="port of node 0's scheduler")
    multi.add_argument("--token", default=None, help="the job token node 0 printed (or AUTOPAR_JOB_TOKEN)")
    multi.add_argument("--hostfile", default=None, help="'host slots=N' lines describing the job (mpirun style)")
    table = p.add_argument_group("rank table")
    table.add_argument("--rank-table", default=None, help="a MindSpore rank table (r1.x or r0.2 JSON)")
    table.add_argument("--server-id", default=None, help="this host's server_id in the rank table")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="run the job again up to K times after a failure")
    p.add_argument("--cluster-timeout", type=float, default=None, metavar="S",
                   help="seconds the workers wait to reach the scheduler and for all to join (default: "
                        "AUTOPAR_CLUSTER_TIMEOUT, else 600 as torchrun's rendezvous)")
    torchrun.add_arguments(p)
    dry = p.add_argument_group("dry run (nothing is launched)")
    dry.add_argument("--dry-run", action="store_true",
                     help="run the script on this CPU as simulated ranks of the N-rank job (fake process group, "
                          "tensors without storage): configuration errors and each rank's peak memory, before a "
                          "cluster is booked; writes LOG_DIR/dryrun.json")
    dry.add_argument("--dry-run-ranks", default=None, metavar="R,R,...",
                     help="the ranks to simulate (default: rank 0 and the first rank of every pipeline stage)")
    dry.add_argument("--dry-run-steps", type=int, default=2, metavar="K",
                     help="optimizer steps to simulate (default 2: the second has the optimizer state)")
    dry.add_argument("--dry-run-machine", default=None, metavar="NAME|FILE",
                     help="the cluster AUTO_PARALLEL plans for in a dry run: a preset (h100-ib, a100-ib) or a cluster "
                          "JSON file (default: this host)")
    dry.add_argument("--dry-run-device", default="cpu", choices=("cpu", "cuda"),
                     help="cuda: every simulated rank has a GPU of its own (the --dry-run-machine's device, else an "
                          "H100 of h100-ib, which AUTO then plans for): the script's CUDA path runs -- set_device, "
                          ".cuda(), NCCL, autocast -- and the table is each GPU's memory (default cpu)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=run)


def _nproc(text: str) -> int:
    """-n / torchrun's --nproc-per-node: a number, or 'auto'/'cpu' (one per core here; no GPU is counted)."""
    if text in ("auto", "cpu"):
        return os.cpu_count() or 1
    if text == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("'gpu': this host has no GPU")
        return torch.cuda.device_count()
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of processes (or auto, cpu, gpu)") from None


def _nnodes(text: str) -> int:
    """--nnodes N; torchrun's elastic 'MIN:MAX' only where MIN == MAX (autopar's jobs have a fixed size)."""
    low, _, high = text.partition(":")
    try:
        n = int(low)
        if high and int(high) != n:
            raise argparse.ArgumentTypeError(f"{text!r}: autopar runs a fixed number of nodes, not an elastic "
                                             f"range: give one number (--nnodes {high})")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of nodes") from None
    return n


def _ranks(text: str | None, flag: str = "--dry-run-ranks") -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes ranks separated by commas, e.g. 0,4; got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from autopar.cluster.launcher import LaunchConfig, launch

    torchrun.apply(args)
    if args.dry_run:
        from autopar.dryrun.driver import dry_run

        if args.hostfile or args.rank_table:
            raise ConfigError("--dry-run simulates -n N ranks per node x --nnodes nodes: give those, not "
                              "--hostfile/--rank-table")
        return dry_run(args.nproc * max(1, args.nnodes), args.script, list(args.script_args), args.log_dir,
                       _ranks(args.dry_run_ranks), args.dry_run_steps, machine=args.dry_run_machine,
                       local_size=args.nproc, device=args.dry_run_device)
    if args.dry_run_ranks is not None or args.dry_run_steps != 2 or args.dry_run_machine is not None \
            or args.dry_run_device != "cpu":
        torchrun.warn("--dry-run-ranks/--dry-run-steps/--dry-run-machine/--dry-run-device act only with --dry-run: "
                      "ignored")

    return launch(LaunchConfig(
        nproc=args.nproc, script=args.script, script_args=list(args.script_args), log_dir=args.log_dir,
        port=args.port, host=args.host, nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
        master_port=args.master_port, token=args.token, hostfile=args.hostfile, rank_table=args.rank_table,
        server_id=args.server_id, max_restarts=args.max_restarts, cluster_timeout=args.cluster_timeout,
        stream_ranks=_ranks(args.console_ranks, "--console-ranks"),
    ))
