"""Entry point of the ``autopar`` command.

Each sub-command lives in its own module exposing ``register(subparsers)``, which adds its parser and sets
``func`` to a callable taking the parsed arguments and returning an exit code. User errors
(:class:`autopar.errors.AutoparError`) are printed as one line, never as a bare traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from autopar.errors import AutoparError

# Sub-command modules, in the order ``autopar --help`` lists them.
COMMANDS = ("launch", "train", "plan", "ckpt", "data")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar",
        description="Distributed parallel training for PyTorch, MindSpore style.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"autopar.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except AutoparError as exc:
        if os.environ.get("AUTOPAR_TRACEBACK"):
            raise
        print(f"autopar: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
