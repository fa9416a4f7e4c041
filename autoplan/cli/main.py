"""The `autoplan` command: flags -> the dataclasses of each stage. Nothing else reads argv.

Each subcommand lives in its own module with `register(subparsers)`, which adds its parser and sets
`func(args) -> int`. Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from autoplan import __version__

# subcommand modules, each owning its flags
_COMMAND_MODULES = ("autoplan.cli.plan", "autoplan.cli.run", "autoplan.cli.profile", "autoplan.cli.serve",
                    "autoplan.cli.validate", "autoplan.cli.calibrate", "autoplan.cli.timeline")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoplan",
        description="Find, explain and run the fastest way to parallelise a PyTorch training job.",
    )
    parser.add_argument("--version", action="version", version=f"autoplan {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # subcommand not built yet
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, PermissionError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"autoplan: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autoplan: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
