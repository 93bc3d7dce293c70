"""How foretell's MLX work is shared among threads.

MLX streams are per thread: a stream, and the work queued on it, are unknown to another
thread ("There is no Stream(cpu, N)"). foretell runs its MLX work on one stream any thread
may use, one thread at a time (:func:`mlx_work`): an engine's requests all run on its
scheduler's worker thread (:mod:`foretell.scheduler`); loading and making a drafter run on
the caller's thread, between the worker's steps.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

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


class WiredMemory:
    """On Apple silicon, the model's memory stays wired while the worker has requests (as
    mlx-lm's generation does); elsewhere nothing. Held and released on the worker thread."""

    def __init__(self) -> None:
        self._previous: int | None = None

    @property
    def held(self) -> bool:
        return self._previous is not None

    def hold(self) -> None:
        if self._previous is None and mx.metal.is_available():
            self._previous = mx.set_wired_limit(
                mx.device_info()["max_recommended_working_set_size"])

    def release(self) -> None:
        if self._previous is not None:
            mx.synchronize(generation_stream())
            mx.set_wired_limit(self._previous)
            self._previous = None
