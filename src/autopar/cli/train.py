"""``autopar train``: the tutorial job (ResNet-50 on CIFAR-10) on N local workers."""
from __future__ import annotations

import argparse
from pathlib import Path

from autopar.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the tutorial ResNet-50 on CIFAR-10 with N local workers",
                       description="Train the tutorials' ResNet-50 on CIFAR-10 (or a generated synthetic CIFAR-10) "
                       "over N local worker processes.")
    p.add_argument("-n", "--nproc", type=int, default=1, help="number of worker processes")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="directory holding cifar-10-batches-bin")
    src.add_argument("--synthetic", action="store_true", help="generate a synthetic CIFAR-10 (no download needed)")
    p.add_argument("--synthetic-records", type=int, default=10000, help="records per synthetic file (10000 = full)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--image-size", type=int, choices=(32, 224), default=32)
    p.add_argument("--mode", default="data_parallel", choices=("stand_alone", "data_parallel", "semi_auto_parallel",
                                                                 "auto_parallel"))
    p.add_argument("--grad-accumulation", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--steps-per-epoch", type=int, default=-1)
    p.add_argument("--print-every", type=int, default=1)
    p.add_argument("--eval", action="store_true", help="report test accuracy at the end")
    p.add_argument("--bn-images", type=int, default=512,
                   help="with --eval: re-estimate BatchNorm statistics on this many training images first (precise "
                        "BN); 0 evaluates with the moving statistics, as MindSpore")
    p.add_argument("--ckpt-steps", type=int, default=0, help="save a checkpoint every N steps into LOG_DIR/ckpt_<rank>")
    p.add_argument("--sliced", action="store_true", help="checkpoints hold each rank's slices (integrated_save=False)")
    p.add_argument("--resume", action="store_true", help="continue after the newest checkpoint in LOG_DIR/ckpt_<rank>")
    p.add_argument("--log-dir", default="autopar_logs")
    p.add_argument("--console-ranks", default=None, metavar="R,R,...",
                   help="the ranks whose lines the console shows (default: every rank, each line prefixed '[rank N]' "
                        "-- each rank's loss is that of its own batch)")
    p.add_argument("--port", type=int, default=None)
    p.set_defaults(func=run)


def synthetic_data(log_dir: str, records: int) -> Path:
    """LOG_DIR/synthetic-cifar10 with ``records`` records per file: the one written by an earlier run is reused
    only when it has that size (else a run asking for 48 would silently train on an earlier 24)."""
    from autopar.dataset.synth import synthetic_records, write_synthetic_cifar10

    out = Path(log_dir) / "synthetic-cifar10"
    have = synthetic_records(out)
    if have != records:
        instead = f", replacing the {have}-record one" if have else ""
        print(f"[autopar] writing a synthetic CIFAR-10 ({records} records per file) to {out}{instead}", flush=True)
        write_synthetic_cifar10(out, records_per_file=records)
    return out


def run(args: argparse.Namespace) -> int:
    from autopar.cluster.launcher import LaunchConfig, launch
    from autopar.train.recipes import resnet_cifar

    if args.nproc < 1:
        raise ConfigError(f"-n must be positive, got {args.nproc}")
    if not args.synthetic:
        check_cifar10_dir(args.data)
    data = str(synthetic_data(args.log_dir, args.synthetic_records)) if args.synthetic else args.data
    script_args = ["--data", data, "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
                   "--image-size", str(args.image_size), "--mode", args.mode,
                   "--grad-accumulation", str(args.grad_accumulation), "--lr", str(args.lr),
                   "--steps-per-epoch", str(args.steps_per_epoch), "--print-every", str(args.print_every)]
    if args.eval:
        script_args += ["--eval", "--bn-images", str(args.bn_images)]
    if args.ckpt_steps or args.resume:
        script_args += ["--ckpt-dir", str(Path(args.log_dir).resolve()), "--ckpt-steps", str(args.ckpt_steps)]
        script_args += ["--sliced"] if args.sliced else []
        script_args += ["--resume"] if args.resume else []
    from autopar.cli.launch import _ranks

    return launch(LaunchConfig(nproc=args.nproc, script=resnet_cifar.__file__, script_args=script_args,
                               log_dir=args.log_dir, port=args.port,
                               stream_ranks=_ranks(args.console_ranks, "--console-ranks")))


def check_cifar10_dir(path: str) -> None:
    """--data checked before any worker starts: a missing directory is one line here, not one per rank later."""
    from autopar.dataset.sources import CIFAR10_TRAIN_FILES, resolve_cifar10_dir
    from autopar.errors import DatasetError

    if not Path(path).expanduser().is_dir():
        raise ConfigError(f"--data {path}: no such directory (give the folder holding cifar-10-batches-bin, or "
                          f"--synthetic to generate one)")
    try:
        resolve_cifar10_dir(path, CIFAR10_TRAIN_FILES)
    except DatasetError as exc:
        raise ConfigError(f"--data {path}: {str(exc).removeprefix('Cifar10Dataset: ')}") from None
