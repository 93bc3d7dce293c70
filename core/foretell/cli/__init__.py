"""The reference CLI: ``foretell run | chat | serve | bench | plugins | cache``.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``; the parser
it adds carries ``handler(args) -> int``. Errors a user can hit exit non-zero with one
line on stderr, never a traceback (``FORETELL_DEBUG=1`` shows it). A reader that closes
the pipe early (``foretell run | head -3``) ends the run quietly with status 141, as a
program killed by SIGPIPE would.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from typing import Any

from foretell import __version__
from foretell.errors import ForetellError

COMMANDS = (
    "foretell.cli.run_cmd",
    "foretell.cli.chat_cmd",
    "foretell.cli.serve_cmd",
    "foretell.cli.bench_cmd",
    "foretell.cli.plugins_cmd",
    "foretell.cli.cache_cmd",
)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` states every option's default: a value set in the parser is appended as
    ``(default: X)``; options whose default is decided later (``None`` in the parser: the
    run config's defaults, the shipped model) say it in their own help text."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        default = action.default
        if ("default" in help_text or not action.option_strings or action.required
                or default is None or default is argparse.SUPPRESS
                or isinstance(default, bool) or default in ([], "")):
            return action.help
        return f"{help_text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse, but bad input is one line on stderr, not a usage block, and ``--help``
    shows defaults (subcommands' parsers are made with this class too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {printable(message)} (see '{self.prog} --help')\n")


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
        with contextlib.suppress(BrokenPipeError):
            print(f"foretell: error: {printable(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        from foretell.cli.cache_cmd import Terminated

        return 143 if isinstance(exc, Terminated) else 130
    except BrokenPipeError:
        _discard_stdout()
        return PIPE_CLOSED


def printable(text: str) -> str:
    """``text`` with the bytes of an undecodable argument (a file name, say) shown as
    ``\\xNN``: it names what the user typed without failing to print."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


#: 128 + SIGPIPE: what a shell reports for a program whose reader went away.
PIPE_CLOSED = 141


def _discard_stdout() -> None:
    # Python flushes stdout again at exit; pointed at /dev/null, that flush cannot raise a
    # second BrokenPipeError ("Exception ignored ...") after we have already returned.
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (a test's capture): nothing will flush it at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
