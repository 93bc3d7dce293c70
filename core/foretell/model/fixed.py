"""Compiled forwards over fixed shapes, for verify windows and a head's steps on CUDA.

On CUDA a speculative round is bound by the host building graph nodes in Python
(docs/speculation.md, "Pipelining and the GPU"). ``mx.compile`` replays a traced graph
without the Python, but only while input shapes repeat, so a forward here sees each growable
cache as its whole buffer (capacity a multiple of :data:`CAPACITY_STEP`) with its offset as
an array, and traces once per window length and capacity (figures: docs/decisions.md).

A compiled forward meets its caches only through the cache protocol (``offset``,
``update_and_fetch``, ``mask``); anything else fails the trace, and that forward falls back
to the ordinary one for good, the real caches untouched. It takes a single request's
growable caches or a batch's caches holding one row (:func:`fits_fixed_shapes`): the
scheduler's verify of a lone row and MTP's rows of one. A batch of several rows keeps the
ordinary forward: its row count changes as rows join and leave, and each count would be
another trace of every window length (docs/decisions.md, "One loop").
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx

from foretell.config import engine_choice
from foretell.model.batch import BatchKVCache
from foretell.model.kvcache import KVCache

log = logging.getLogger(__name__)

#: Buffers grow in steps of this many tokens on the fixed path, so a long generation
#: re-traces a forward once per step, not once per 256 tokens.
CAPACITY_STEP = 1024
#: Windows longer than this take the ordinary forward: every new length is a new trace (and
#: on CUDA new kernels), and longer ones (a drafter catching up after plain steps, prompt
#: chunks) come in lengths that rarely repeat. A verify window is at most this long: the
#: pending token and up to 16 drafts (``DraftConfig.num_tokens`` is capped there).
MAX_TOKENS = 17

_TRACES = 0


def trace_count() -> int:
    """Forwards traced so far in this process (one per new window length and capacity of
    each compiled forward). A round during which it grew paid a one-off cost (the trace and,
    on CUDA, its kernels), so the draft-length policy does not time it."""
    return _TRACES


class _Slot:
    """A cache as a compiled forward sees it: its whole buffers and an array offset."""

    __slots__ = ("keys", "values", "offset", "_mask")

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset
        self._mask: tuple[int, mx.array] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        at = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, keys.astype(self.keys.dtype), at, axes=(2,))
        self.values = mx.slice_update(self.values, values.astype(self.values.dtype), at, axes=(2,))
        return self.keys, self.values

    def mask(self, n_queries: int) -> mx.array:
        """Query ``i`` (at position ``offset + i``) may read the keys at or before it; the
        slots past the newest query hold stale or zero keys and stay hidden."""
        if self._mask is None or self._mask[0] != n_queries:
            query = self.offset + mx.arange(n_queries)[:, None]
            self._mask = (n_queries, mx.arange(self.keys.shape[2])[None] <= query)
        return self._mask[1]


def fits_fixed_shapes(caches: Sequence[Any]) -> bool:
    """Growable caches that already hold keys, all at one offset: a single request's
    :class:`KVCache` layers, or a batch's full-attention, unquantized
    :class:`~foretell.model.batch.BatchKVCache` layers holding one row."""
    if not caches:
        return False
    offset = _offset(caches[0])
    return offset is not None and all(_offset(c) == offset for c in caches)


def _offset(cache: Any) -> int | None:
    """Where ``cache``'s next token goes, or None if a fixed forward cannot take it."""
    if type(cache) is KVCache:
        return cache.offset if cache.keys is not None else None
    if type(cache) is BatchKVCache and cache.rows == 1 and cache.buffers is not None \
            and cache.window is None and not cache.starts[0]:
        return cache.lengths[0]
    return None


def _buffers(cache: Any) -> tuple[mx.array, mx.array]:
    return (cache.keys, cache.values) if type(cache) is KVCache else cache.buffers


def _advance(cache: Any, keys: mx.array, values: mx.array, n: int) -> None:
    """``cache`` holds ``keys`` and ``values`` (whole buffers), ``n`` tokens more."""
    if type(cache) is KVCache:
        cache.keys, cache.values = keys, values
        cache.offset += n
    else:
        cache.written(keys, values, n)


class FixedForward:
    """``fn(owner, *arrays, caches) -> tuple of arrays`` compiled over fixed shapes.

    ``owner`` (a model or a head) is held weakly. ``fn`` must treat ``caches`` through the
    cache protocol only; ``__call__`` takes and updates real caches (a single request's or
    a one-row batch's, see :func:`fits_fixed_shapes`) and returns ``fn``'s outputs. ``None``
    comes back instead when ``fn`` cannot be traced this way or the caches do not qualify;
    the caller then runs its ordinary forward (nothing changed)."""

    def __init__(self, owner: Any, fn: Callable[..., tuple[mx.array, ...]],
                 name: str = "forward"):
        self.fn, self.name = fn, name
        self._owner = weakref.ref(owner)
        self.failed = False
        self._compiled = mx.compile(self._traced)
        self._arity = 0
        self._traced_shapes: set[tuple[Any, ...]] = set()

    def _traced(self, offset: mx.array, *flat: mx.array) -> tuple[mx.array, ...]:
        arrays, buffers = flat[: self._arity], flat[self._arity :]
        slots = [_Slot(buffers[i], buffers[i + 1], offset) for i in range(0, len(buffers), 2)]
        outputs = self.fn(self._owner(), *arrays, slots)
        return (*outputs, *[b for s in slots for b in (s.keys, s.values)])

    def __call__(self, *arrays: mx.array, caches: Sequence[Any], length: int
                 ) -> tuple[mx.array, ...] | None:
        """Run over ``length`` new tokens; None (caches untouched) if ``fn`` cannot, the
        caches do not qualify (:func:`fits_fixed_shapes`) or the window is longer than
        :data:`MAX_TOKENS`: the caller then runs its ordinary forward."""
        global _TRACES
        if self.failed or length > MAX_TOKENS or not fits_fixed_shapes(caches):
            return None
        offset = _offset(caches[0])
        for cache in caches:
            # A whole multiple of CAPACITY_STEP, also after plain steps or a head's chained
            # steps grew it by 256: any other capacity would be one more trace per window.
            cache.reserve(offset + length, CAPACITY_STEP)
        self._arity = len(arrays)
        buffers = [b for c in caches for b in _buffers(c)]
        shapes = tuple((a.shape, a.dtype) for a in (*arrays, *buffers))
        try:
            out = self._compiled(mx.array(offset, dtype=mx.int32), *arrays, *buffers)
        except Exception as exc:  # a layer that needs more of its cache than the protocol
            self.failed = True
            log.warning("foretell: the %s cannot run over fixed shapes (%s: %s); it takes "
                        "the ordinary path", self.name, type(exc).__name__, exc)
            return None
        if shapes not in self._traced_shapes:
            self._traced_shapes.add(shapes)
            _TRACES += 1
        n = len(out) - len(buffers)
        for i, cache in enumerate(caches):
            _advance(cache, out[n + 2 * i], out[n + 2 * i + 1], length)
        return out[:n]


_MODE: str | None = None


def fixed_shapes_on() -> bool:
    """Whether verify windows take fixed-shape compiled forwards: on CUDA by default, where a
    round is bound by the host's graph building; the CPU and Metal keep the ordinary
    forward (their rounds are bound by compute). An engine's ``fixed_shapes`` setting
    (``on``/``off``) forces either for its requests; ``FORETELL_FIXED_SHAPES`` is the
    process's default (``on`` is how the CPU tests exercise this path)."""
    global _MODE
    chosen = engine_choice("fixed_shapes")
    if chosen is not None:
        return chosen == "on"
    if _MODE is None:
        from foretell.platform.device import device_mode

        _MODE = device_mode("FORETELL_FIXED_SHAPES", cuda="on", elsewhere="off",
                            choices=("on", "off"))
    return _MODE == "on"


@contextlib.contextmanager
def forced(mode: str) -> Iterator[None]:
    """Fixed shapes ``"on"`` or ``"off"`` for the requests started inside (a benchmark's
    A/B in one process); the process's own setting afterwards."""
    global _MODE
    if mode not in ("on", "off"):
        raise ValueError(f"fixed shapes are 'on' or 'off', not {mode!r}")
    saved, _MODE = _MODE, mode
    try:
        yield
    finally:
        _MODE = saved


_BY_OWNER: dict[tuple[int, str], FixedForward] = {}


def fixed_for(owner: Any, name: str, fn: Callable[..., tuple[mx.array, ...]]
              ) -> FixedForward | None:
    """The one :class:`FixedForward` named ``name`` for ``owner`` (a model or a head), so
    every request replays the same traces; it goes when the owner does (``fn`` must not
    hold the owner: it is handed it). None where fixed shapes are off
    (:func:`fixed_shapes_on`, read at each call)."""
    if not fixed_shapes_on():
        return None
    key = (id(owner), name)
    found = _BY_OWNER.get(key)
    if found is None:
        found = _BY_OWNER[key] = FixedForward(owner, fn, name)
        weakref.finalize(owner, _BY_OWNER.pop, key, None)
    return found


def fixed_or_ordinary(owner: Any, name: str, fn: Callable[..., tuple[mx.array, ...]],
                      *arrays: mx.array, caches: Sequence[Any]) -> tuple[mx.array, ...]:
    """``fn(owner, *arrays, caches)``: replayed over fixed shapes (:func:`fixed_for`) where
    they are on, the window (``arrays[0]``'s second axis) is longer than one token and the
    caches qualify; otherwise ``fn`` itself. A one-token window (a plain step) keeps the
    ordinary forward, as plain decoding does."""
    length = arrays[0].shape[1]
    if length > 1:
        run = fixed_for(owner, name, fn)
        if run is not None:
            out = run(*arrays, caches=caches, length=length)
            if out is not None:
                return out
    return fn(owner, *arrays, caches)

