"""The `hybridmoe` console command.

Each subcommand lives in its own module in this package and exposes `add_parser(subparsers)`,
which registers the subcommand and sets `func` (called with the parsed args, returns an exit code).
Add a new subcommand by writing its module and naming it in COMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from hybridmoe.errors import UserError

COMMANDS = [
    "generate",
    "chat",
    "bench",
    "calibrate",
    "serve",
    "simulate",
    "plan",
    "demo-model",
    "finetune",
    "export",
]


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: with a command first, only that command's module is imported (so
    `hybridmoe simulate` never imports torch); otherwise all of them, for help and errors."""
    parser = argparse.ArgumentParser(
        prog="hybridmoe",
        description="Run and serve Mixture-of-Experts LLMs with experts split between CPU and GPU.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    wanted = [argv[0]] if argv and argv[0] in COMMANDS else COMMANDS
    for name in wanted:
        importlib.import_module(f"hybridmoe.cli.{name.replace('-', '_')}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(format="hybridmoe: %(message)s", level=logging.WARNING, stream=sys.stderr)
    try:
        code = args.func(args)
    except UserError as e:
        print(f"hybridmoe: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
