"""A one-line progress display on stderr, drawn only for a person at a terminal.

Pipes, files and ``--json`` runs get nothing, so captured output stays clean.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 30


class ProgressLine:
    """``label [#####.....] 1234/4096`` (or ``label... 1.2s`` without a total), redrawn in
    place and erased by :meth:`close`."""

    def __init__(self, label: str, *, enabled: bool = True, stream: TextIO | None = None):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.started = time.perf_counter()
        self._drawn = 0
        self._last = 0.0

    @classmethod
    def for_terminal(cls, label: str, *, quiet: bool = False) -> ProgressLine:
        return cls(label, enabled=not quiet and sys.stderr.isatty())

    def update(self, done: int | None = None, total: int | None = None) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        # Redrawing costs a write per call; a few per second is all an eye can follow.
        if self._drawn and now - self._last < 0.1 and done != total:
            return
        self._last = now
        if total:
            filled = WIDTH * min(done or 0, total) // total
            bar = "#" * filled + "." * (WIDTH - filled)
            line = f"{self.label} [{bar}] {done}/{total}"
        else:
            line = f"{self.label}... {now - self.started:.1f}s"
        self._write(line)

    def __call__(self, done: int, total: int) -> None:
        self.update(done, total)

    def close(self) -> None:
        if self.enabled and self._drawn:
            self._write("")
            self.stream.write("\r")
            self.stream.flush()
            self._drawn = 0

    def __enter__(self) -> ProgressLine:
        self.update()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, line: str) -> None:
        pad = " " * max(0, self._drawn - len(line))
        self.stream.write(f"\r{line}{pad}")
        self.stream.flush()
        self._drawn = len(line)
