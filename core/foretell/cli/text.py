"""Text a person hands the CLI: flag values and stdin, checked and unescaped in one place.

The tokenizer takes Unicode text. Bytes that are not UTF-8 reach Python as lone surrogates
(``os.fsdecode`` of argv, stdin read with ``surrogateescape``), which the tokenizer rejects
with a bare TypeError; here they become one error naming the flag and the byte.
"""

from __future__ import annotations

import sys

from foretell.errors import ConfigError


def checked(value: str, flag: str) -> str:
    """``value`` if it is valid Unicode text; else an error naming ``flag`` and the byte."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raw = value[exc.start].encode("utf-8", "surrogateescape")
        raise ConfigError(
            flag, [f"not UTF-8 text (byte 0x{raw[0]:02x} at character {exc.start})"]
        ) from None
    return value


def unescape(value: str) -> str:
    """``\\n`` and ``\\t`` typed in a shell become a newline and a tab, as mlx-lm does."""
    return value.replace("\\n", "\n").replace("\\t", "\t")


def decode(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            what, [f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"]
        ) from None


def read_stdin(what: str = "--prompt -") -> str:
    """All of stdin as text."""
    stream = sys.stdin
    buffer = getattr(stream, "buffer", None)
    if buffer is None:  # a text-only stream (tests, embedding): already decoded
        return checked(stream.read(), what)
    return decode(buffer.read(), what)


def read_stdin_line(what: str = "stdin") -> str:
    """One line of stdin ("" at end of input)."""
    stream = sys.stdin
    buffer = getattr(stream, "buffer", None)
    if buffer is None:
        return checked(stream.readline(), what)
    return decode(buffer.readline(), what)
