"""``autopar data``: prepare datasets on disk.

    autopar data synth-cifar10 OUT [--records-per-file N] [--seed S]   # offline, learnable stand-in
    autopar data download-cifar10 OUT                                  # the real archive (needs internet)

Thin on purpose: parse arguments, call :mod:`autopar.dataset.synth` / :mod:`autopar.dataset.download`, report.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path


def _report(target: Path, seconds: float) -> None:
    from autopar.dataset.sources import CIFAR10_RECORD

    total = 0
    for path in sorted(target.iterdir()):
        if path.suffix == ".bin":
            records = path.stat().st_size // CIFAR10_RECORD
            total += records
            print(f"  {path}  {records} records")
        else:
            print(f"  {path}")
    print(f"{total} records in {target} ({seconds:.2f} s)")


def _synth(args: argparse.Namespace) -> int:
    from autopar.dataset.synth import write_synthetic_cifar10

    start = time.perf_counter()
    target = write_synthetic_cifar10(args.out, records_per_file=args.records_per_file, seed=args.seed)
    print(f"wrote synthetic CIFAR-10 (seed {args.seed}):")
    _report(target, time.perf_counter() - start)
    return 0


def _download(args: argparse.Namespace) -> int:
    from autopar.dataset.download import download_cifar10

    start = time.perf_counter()
    target = download_cifar10(args.out)
    print("CIFAR-10 ready:")
    _report(target, time.perf_counter() - start)
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="prepare datasets (synthetic or downloaded CIFAR-10)",
                                   description="Prepare datasets on disk.")
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION")
    sub.required = True

    synth = sub.add_parser("synth-cifar10", help="write a learnable synthetic CIFAR-10 in the binary layout")
    synth.add_argument("out", metavar="OUT", help="directory that receives cifar-10-batches-bin/")
    synth.add_argument("--records-per-file", type=int, default=10000, metavar="N",
                       help="records in each of the 6 .bin files (default 10000, as the real data)")
    synth.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    synth.set_defaults(data_func=_synth)

    download = sub.add_parser("download-cifar10", help="download and extract the real CIFAR-10 (binary version)")
    download.add_argument("out", metavar="OUT", help="directory that receives cifar-10-batches-bin/")
    download.set_defaults(data_func=_download)

    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the chosen action (stored as ``data_func`` by its sub-parser); returns the exit code."""
    return int(args.data_func(args) or 0)
