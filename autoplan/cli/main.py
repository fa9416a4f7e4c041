"""The `autoplan` command: flags -> the dataclasses of each stage. Nothing else reads argv.

Each subcommand lives in its own module with `register(subparsers)`, which adds its parser and sets
`func(args) -> int`. Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import gc
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
        if isinstance(exc, KeyError) and " " not in str(message):
            raise  # autoplan's own KeyErrors say what is missing in a sentence; a bare key is a bug: its traceback
        print(f"autoplan: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autoplan: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The console script: main(), then an exit that does not walk the heap. A process that imported torch and
    torch._dynamo (a cold plan) spent 0.6-0.9 s here in the interpreter's shutdown collections and teardown of
    objects it is about to drop anyway; gc.freeze() moves them out of the collector's sight first ("ignore
    them in all future collections", Python docs, gc.freeze), which leaves about 0.2 s. Output is flushed and
    atexit handlers run as usual."""
    code = main()
    sys.stdout.flush()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
