"""What a request streams: text events, the final stats, and the streaming rule.

:class:`StreamCut` turns each step's tokens of a request (a plain step, a verified draft,
a resumed checkpoint's replay) into text: it cuts them at EOS, a stop string or
``max_tokens``, detokenizes them, and records where the request ended.
:class:`RequestHandle` carries the events from the scheduler's worker to the caller.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from foretell.request import RequestState
    from foretell.tokenizer import Tokenizer


@attrs.frozen
class TextEvent:
    """Text that became final, and the token ids this step produced.

    ``text`` may be ``""`` (a character still arriving, or text held back because it could
    start a stop string); ``tokens`` is empty for the flush at the end. EOS is never here.
    """

    text: str
    tokens: tuple[int, ...]
    type: str = "text"
    #: When the request asked for them: one :class:`TokenLogprobs` per token of ``tokens``.
    logprobs: tuple[TokenLogprobs, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = {"type": self.type, "text": self.text, "tokens": list(self.tokens)}
        if self.logprobs:
            out["logprobs"] = [attrs.asdict(lp) for lp in self.logprobs]
        return out


@attrs.frozen
class TokenLogprobs:
    """A token's log-probability under the model (its raw distribution, before sampling's
    temperature and truncation, as OpenAI's API reports it), and the most likely
    alternatives as ``(token id, log-probability)``, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen(kw_only=True)
class Stats:
    """The last event of every request.

    ``finish_reason``: ``"eos"`` (the model ended), ``"stop"`` (a stop string), or
    ``"length"`` (``max_tokens``). ``generated_tokens`` counts every token the model chose,
    EOS included. ``prompt_tps`` counts prompt tokens actually computed (not reused from a
    cache) over the time to the first token; ``generation_tps`` counts generated tokens over
    the time after the first one, as mlx-lm does.
    """

    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int
    ttft_s: float
    prompt_tps: float
    generation_tps: float
    peak_memory_gb: float
    finish_reason: str
    #: Drafting figures (drafter, drafted, accepted, ...) when the request speculated.
    speculation: dict[str, Any] | None = None
    #: Seconds the request waited for a place in the batch (submitted to admitted); not in
    #: ``ttft_s``, which starts at admission.
    queued_s: float = 0.0
    #: Where the ``cached_tokens`` came from: "ram", "ssd", "checkpoint" (None: computed).
    cached_from: str | None = None
    #: Generated tokens a resumed request restored from its checkpoint (counted in
    #: ``generated_tokens``, streamed again, not computed, so not in ``generation_tps``).
    resumed_tokens: int = 0
    type: str = "stats"

    def to_dict(self) -> dict[str, Any]:
        fields = attrs.asdict(self)
        return {"type": fields.pop("type"), **fields}


Event = TextEvent | Stats


class StopMatcher:
    """Cuts the text stream at the first stop string, which may span tokens.

    Text that could still grow into a stop string is held back until it cannot, so a stop
    string is never emitted, even in part.
    """

    def __init__(self, stops: Iterable[str]):
        # A lone string is one stop string, not a set of one-character stops.
        stops = (stops,) if isinstance(stops, str) else stops
        self.stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """``(text safe to emit, whether a stop string was hit)``."""
        if not self.stops:
            return text, False
        pending = self._held + text
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return pending[: min(hits)], True
        keep = self._partial_suffix(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest


class StreamCut:
    """The streaming rule, fed one step at a time: cuts a step's tokens at EOS, a stop string
    or ``max_tokens``, detokenizes them, and records where the request ended in ``state``.
    The scheduler pushes each row's steps through its own."""

    def __init__(self, state: RequestState, tokenizer: Tokenizer, stops: StopMatcher,
                 eos: frozenset[int], max_tokens: int):
        self.state, self.stops, self.eos, self.max_tokens = state, stops, eos, max_tokens
        self.detok = tokenizer.detokenizer()
        self.finish: str | None = None
        self._at_stop_string = False
        #: When the first step arrived (None until one did).
        self.first_at: float | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None or self.state.consumed >= self.max_tokens

    def feed(self, step_tokens: list[int]) -> TextEvent | None:
        """One step's tokens (a speculative burst is cut exactly where plain decoding would
        have stopped); the event to stream, if the step emitted any token."""
        if self.first_at is None:
            self.first_at = time.perf_counter()
        emitted: list[int] = []
        text = ""
        for token in step_tokens:
            self.state.consumed += 1
            if token in self.eos:
                self.finish = "eos"
                break
            emitted.append(token)
            piece, hit = self.stops.feed(self.detok.add(token))
            text += piece
            if hit:
                self.finish, self._at_stop_string = "stop", True
                break
            if self.state.consumed >= self.max_tokens:
                break
        return TextEvent(text, tuple(emitted)) if emitted else None

    def complete(self) -> None:
        """The output is whole (a grammar finished it): end here, finish reason ``"stop"``."""
        if self.finish is None:
            self.finish = "stop"

    def close(self) -> TextEvent | None:
        """The request ended: the text still held back, if any."""
        tail = ""
        if not self._at_stop_string:
            tail, hit = self.stops.feed(self.detok.flush())
            if hit:
                self.finish = "stop"
            else:
                tail += self.stops.flush()
        self.state.finish_reason = self.finish or "length"
        return TextEvent(tail, ()) if tail else None


#: What a :class:`RequestHandle`'s queue holds after a request's last event.
END = object()


class RequestHandle:
    """One submitted request: iterate it (from any thread, or ``async for`` over
    :meth:`events`) for its events; :meth:`cancel` ends it and frees its KV at the worker's
    next step."""

    def __init__(self, wake: Callable[[], None], prompt_tokens: int) -> None:
        self._wake = wake
        #: When it was submitted (``time.perf_counter``): its wait for admission starts here.
        self.submitted_at = time.perf_counter()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self.prompt_tokens = prompt_tokens
        #: Set while :meth:`events` awaits: wakes its event loop after each item is queued.
        self._wakeup: Callable[[], None] | None = None

    def __iter__(self) -> Iterator[Event]:
        while True:
            item = self._queue.get()
            if item is END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def events(self) -> AsyncIterator[Event]:
        """The events, awaited without blocking the event loop or holding a thread (a
        server streams many requests at once; a thread per waiting stream would exhaust
        the loop's executor)."""
        async for batch in self.batches():
            for item in batch:
                yield item

    async def batches(self) -> AsyncIterator[list[Event]]:
        """The events as :meth:`events` has them, in lists: each, every event that had
        arrived when the caller was woken (a server writes each list out in one piece)."""
        import asyncio

        ready = asyncio.Event()
        waker = _LoopWaker.of(asyncio.get_running_loop())
        self._wakeup = lambda: waker.wake(ready)
        try:
            while True:
                ready.clear()  # before the reads: an item queued after them sets it again
                batch: list[Event] = []
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is END or isinstance(item, BaseException):
                        if batch:
                            yield batch
                        if item is END:
                            return
                        raise item
                    batch.append(item)
                if batch:
                    yield batch
                else:
                    await ready.wait()
        finally:
            self._wakeup = None

    def text(self) -> str:
        return "".join(e.text for e in self if e.type == "text")

    def cancel(self) -> None:
        self._cancelled.set()
        self._wake()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _put(self, item: Any) -> None:
        self._queue.put(item)
        wakeup = self._wakeup
        if wakeup is not None:
            wakeup()


class _LoopWaker:
    """Wakes an event loop's waiting streams from the worker's thread with one call into
    the loop for all that became ready before it ran, not one per row: a batch step queues
    an item for each of its rows, and each ``call_soon_threadsafe`` writes to the loop's
    wake-up pipe while holding the interpreter the worker needs for its next step."""

    def __init__(self, loop: Any) -> None:
        self._loop = weakref.ref(loop)  # a strong one would keep _WAKERS' key alive for good
        self._lock = threading.Lock()
        self._ready: set[Any] = set()
        self._called = False  # a call into the loop is on its way

    @staticmethod
    def of(loop: Any) -> _LoopWaker:
        waker = _WAKERS.get(loop)
        if waker is None:
            waker = _WAKERS[loop] = _LoopWaker(loop)
        return waker

    def wake(self, ready: Any) -> None:
        with self._lock:
            self._ready.add(ready)
            if self._called:
                return
            self._called = True
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the loop is gone")
            loop.call_soon_threadsafe(self._set)
        except RuntimeError:  # the loop closed while its requests ran on
            with self._lock:
                self._ready.clear()
                self._called = False

    def _set(self) -> None:
        with self._lock:
            ready, self._ready, self._called = self._ready, set(), False
        for event in ready:
            event.set()


#: Each event loop's waker; a closed loop's goes with it.
_WAKERS: weakref.WeakKeyDictionary[Any, _LoopWaker] = weakref.WeakKeyDictionary()


def merged(handles: Sequence[RequestHandle]) -> Iterator[tuple[int, Event]]:
    """Every event of ``handles`` as ``(index, event)``, read from the calling thread, each
    handle's in order, until all have ended (a request's error is raised here).

    One thread reading many requests this way wakes once per batch step, where a thread per
    handle wakes once per request per step and each waits for the GIL in turn (what a large
    batch's step costs on a GPU, docs/batching.md). A handle is read one way at a time: not
    also iterated or awaited elsewhere while merged."""
    ready = threading.Event()
    for handle in handles:
        handle._wakeup = ready.set
    live = list(range(len(handles)))
    try:
        while live:
            ready.clear()  # before the reads: an item queued after them sets it again
            got = False
            for i in list(live):
                source = handles[i]._queue
                while True:
                    try:
                        item = source.get_nowait()
                    except queue.Empty:
                        break
                    got = True
                    if item is END:
                        live.remove(i)
                        break
                    if isinstance(item, BaseException):
                        raise item
                    yield i, item
            if not got:
                ready.wait()
    finally:
        for handle in handles:
            handle._wakeup = None
