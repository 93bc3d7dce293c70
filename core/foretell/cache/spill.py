"""Writes to the SSD tier off the decode path: a byte-capped queue drained by one worker
thread, and the durability report ``flush()`` gives.

The queue holds snapshots whose arrays are already evaluated (the request thread evaluates
them before submitting), so the worker only copies bytes to disk and never runs MLX work.
Over the byte cap the *oldest* queued snapshot not yet being written is dropped (invariant
10): a newer state of a conversation is worth more than an older one. Dropped and failed
writes are counted and reported, never forgotten: "durable" is claimed only when nothing is
pending, dropped or failed (invariant 9).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs

from foretell.errors import ConfigError
from foretell.store.entry import Entry
from foretell.store.format import background_priority, parallel_reads

log = logging.getLogger("foretell.cache")

Done = Callable[[Entry, str], None]  # outcome: "stored", "failed" or "dropped"


@attrs.frozen(kw_only=True)
class FlushReport:
    """What ``flush`` found: durable only if every stored state is on disk."""

    durable: bool
    #: Snapshots still queued or being written when the wait ended.
    pending: int
    #: States that were dropped from the queue or failed to write and are not on disk.
    dropped: int
    failed: int
    #: States no longer held anywhere that could be written (evicted from RAM, not on disk);
    #: each is reported by one flush, then let go.
    missing: int

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def shortfall(self) -> str:
        """What kept it from being durable, in words."""
        return (f"pending {self.pending}, dropped {self.dropped}, failed {self.failed}, "
                f"missing {self.missing}")


#: How long closing a tier waits for its queued writes: ``run`` and ``chat`` on exit (or
#: SIGINT/SIGTERM), and the interpreter's exit for a tier still open
#: (``foretell.cache.tier``).
CLOSE_TIMEOUT_S = 10.0


#: ``default_duty`` on a host with fewer than ``PARALLEL_READ_CORES`` cores.
SMALL_HOST_DUTY = 0.1


def default_duty() -> float:
    """The share of its running time the spill worker may spend writing: all of it on a host
    with cores to spare, a tenth where a decode keeps every core busy, where a writer
    that never rests slows it measurably (figures: docs/decisions.md). ``FORETELL_SPILL_DUTY``
    (0 < d <= 1) sets it."""
    forced = os.environ.get("FORETELL_SPILL_DUTY")
    if not forced:
        return 1.0 if parallel_reads() else SMALL_HOST_DUTY
    try:
        return Pace(float(forced)).duty  # Pace checks the range
    except ValueError:
        raise ConfigError("FORETELL_SPILL_DUTY",
                          [f"{forced!r} is not a number in (0, 1]"]) from None


@attrs.define
class Pace:
    """Keeps a background writer to ``duty`` of its time: after a write of ``t`` seconds the
    next one may start ``t * (1 / duty - 1)`` seconds later (``duty`` 1: at once)."""

    duty: float = attrs.field(validator=attrs.validators.and_(attrs.validators.gt(0.0),
                                                              attrs.validators.le(1.0)))
    _ready_at: float = 0.0

    def wrote(self, seconds: float) -> None:
        self._ready_at = time.monotonic() + seconds * (1.0 / self.duty - 1.0)

    def rest(self) -> float:
        """Seconds to wait before the next write."""
        return max(0.0, self._ready_at - time.monotonic())


class SpillQueue:
    """A serial writer thread fed through a queue bounded in bytes, writing at most ``duty``
    of the time (:class:`Pace`) except while someone waits for it to drain."""

    def __init__(self, write: Callable[[Entry], bool], max_bytes: int, on_done: Done,
                 duty: float | None = None):
        self._write = write
        self._on_done = on_done
        self.max_bytes = max_bytes
        self.pace = Pace(default_duty() if duty is None else duty)
        self._queue: deque[Entry] = deque()
        self._queued_bytes = 0
        self._in_flight: Entry | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._draining = 0  # callers waiting in drain(): write at once, no rests
        self.dropped = 0

    def submit(self, entry: Entry) -> None:
        """Queue ``entry`` for writing; drops the oldest queued ones if over the byte cap.
        After :meth:`close` the entry itself is dropped (a request still running as its tier
        closes keeps generating; a later flush writes what RAM still holds)."""
        dropped = []
        with self._cond:
            if self._closed:
                dropped.append(entry)
            else:
                self._queue.append(entry)
                self._queued_bytes += entry.tensor_bytes
                while self._queued_bytes > self.max_bytes and len(self._queue) > 1:
                    old = self._queue.popleft()
                    self._queued_bytes -= old.tensor_bytes
                    dropped.append(old)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="foretell-spill",
                                                    daemon=True)
                    self._thread.start()
                self._cond.notify_all()
            self.dropped += len(dropped)
        for old in dropped:
            self._on_done(old, "dropped")

    def take_dropped(self) -> int:
        """Entries dropped since the last call."""
        with self._cond:
            dropped, self.dropped = self.dropped, 0
            return dropped

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + (self._in_flight is not None)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued snapshot has been written (or failed); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._draining += 1
            self._cond.notify_all()
            try:
                while self._queue or self._in_flight is not None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
            finally:
                self._draining -= 1
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Finish what is queued (bounded by ``timeout``), then stop the worker."""
        drained = self.drain(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return drained

    def _run(self) -> None:
        background_priority()  # writes take the CPU a decode leaves idle
        while True:
            with self._cond:
                while True:
                    rest = 0.0 if self._draining or self._closed else self.pace.rest()
                    if self._queue and rest <= 0:
                        break
                    if not self._queue and self._closed:
                        return
                    self._cond.wait(rest if self._queue else None)
                entry = self._queue.popleft()
                self._queued_bytes -= entry.tensor_bytes
                self._in_flight = entry
            start = time.monotonic()
            try:
                outcome = "stored" if self._write(entry) else "failed"
            except Exception:  # the cold tier never takes serving down (invariant 9)
                log.exception("cache spill write failed")
                outcome = "failed"
            self.pace.wrote(time.monotonic() - start)
            self._on_done(entry, outcome)
            with self._cond:
                self._in_flight = None
                self._cond.notify_all()
