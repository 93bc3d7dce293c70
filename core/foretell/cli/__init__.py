"""The reference CLI: ``foretell run | chat | bench | plugins``.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``; the parser
it adds carries ``handler(args) -> int``. Errors a user can hit exit non-zero with one
line on stderr, never a traceback (``FORETELL_DEBUG=1`` shows it).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from foretell import __version__
from foretell.errors import ForetellError

COMMANDS = (
    "foretell.cli.run_cmd",
    "foretell.cli.chat_cmd",
    "foretell.cli.bench_cmd",
    "foretell.cli.plugins_cmd",
)


class _Parser(argparse.ArgumentParser):
    """argparse, but bad input is one line on stderr, not a usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="foretell",
        description="Fast LLM inference on MLX: a minimal core plus plugins.",
    )
    parser.add_argument("--version", action="version", version=f"foretell {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMANDS:
        importlib.import_module(module_name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except ForetellError as exc:
        if os.environ.get("FORETELL_DEBUG"):
            raise
        print(f"foretell: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
