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
    parser.commands = sub.choices  # each sub-command's parser: a wrong flag is reported under its usage
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the sub-command's own usage, not the top level's: that is where the flag was looked for
        parser.commands[args.command].error(
            f"unrecognized arguments: {' '.join(unknown)}")
    return guarded("autopar", lambda: args.func(args))


def guarded(prog: str, run) -> int:
    """``run()``'s exit code; an autopar error is one line and exit 2 (``AUTOPAR_TRACEBACK=1`` re-raises it),
    Ctrl-C exit 130 -- the same for ``autopar`` and ``msrun``."""
    try:
        return int(run() or 0)
    except AutoparError as exc:
        if os.environ.get("AUTOPAR_TRACEBACK"):
            raise
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
