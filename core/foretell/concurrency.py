"""How foretell's MLX work is shared among threads.

MLX streams are per thread: a stream, and the work queued on it, are unknown to another
thread ("There is no Stream(cpu, N)"). foretell runs its MLX work on one stream any thread
may use, one thread at a time (:func:`mlx_work`), and an engine serves one request at a time
(:class:`OneAtATime`) until the batched engine runs all requests on one worker thread.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from foretell.errors import GenerationError

_STREAM: Any = None
#: Held while foretell drives MLX (a step of a generation, a load, a drafter's warm-up), on
#: whichever thread: MLX is not made to be driven from two threads at once.
_MLX_WORK = threading.RLock()


def generation_stream() -> Any:
    """The one stream all generation work runs on (as mlx-lm does), created on first use.

    A stream made by one thread is unknown to another ("There is no Stream(cpu, N)"), and so
    is the work queued on it, so this one is made usable from any thread (MLX >= 0.31);
    :func:`mlx_work` keeps its users to one at a time."""
    global _STREAM
    if _STREAM is None:
        make = getattr(mx, "new_thread_unsafe_stream", None) or getattr(
            mx, "new_thread_local_stream", mx.new_stream)
        _STREAM = make(mx.default_device())
    return _STREAM


class _ClearsStreamsAtExit:
    """Kept in a thread's locals from its first MLX work on: as the thread ends, its MLX
    streams end with it (MLX 0.32 otherwise aborts the process at exit, at random, over a
    stream of a thread long gone)."""

    def __init__(self) -> None:
        self._pid = os.getpid()

    def __del__(self) -> None:
        # A forked child drops the locals of threads it did not inherit (the scheduler's
        # worker): their streams' MLX threads are not in the child, and waiting on them hangs.
        if os.getpid() != self._pid:
            return
        mx.synchronize()
        mx.clear_streams()


_THREAD = threading.local()


@contextlib.contextmanager
def mlx_work() -> Iterator[None]:
    """Drive MLX here: one thread at a time, on :func:`generation_stream`."""
    with _MLX_WORK:
        if (not hasattr(_THREAD, "streams") and hasattr(mx, "clear_streams")
                and threading.current_thread() is not threading.main_thread()):
            _THREAD.streams = _ClearsStreamsAtExit()
        with mx.stream(generation_stream()):
            yield


class OneAtATime:
    """An engine's lock, held across a whole generation (its drafter and its RAM state serve
    one request at a time; a batched engine will lift this).

    Any thread may step the generation that holds it. A thread that already runs a holder's
    step (a drafter's warm-up generating inside :meth:`Engine.use_draft`) runs inside that
    holder; a thread that would wait on a generation it left open itself is told so instead
    of waiting forever."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_thread: int | None = None
        self._here = threading.local()

    def acquire(self) -> bool:
        """Take the lock, waiting for the holder to finish; False when this thread runs a
        holder's step now (the caller then runs inside it and must not release)."""
        if getattr(self._here, "depth", 0):
            return False
        if not self._lock.acquire(blocking=False):
            if self._last_thread == threading.get_ident():
                raise GenerationError(
                    "this thread left another generation of this engine open: an engine "
                    "serves one request at a time, so finish or close() that one first")
            self._lock.acquire()
        self._last_thread = threading.get_ident()
        return True

    def release(self) -> None:
        self._last_thread = None
        self._lock.release()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock (or run inside this thread's holder) for a section that ends here."""
        taken = self.acquire()
        try:
            with self.running():
                yield
        finally:
            if taken:
                self.release()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """A step of the holder runs on this thread."""
        self._last_thread = threading.get_ident()
        self._here.depth = getattr(self._here, "depth", 0) + 1
        try:
            with mlx_work():
                yield
        finally:
            self._here.depth -= 1
