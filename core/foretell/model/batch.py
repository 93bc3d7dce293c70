"""Batched KV caches: many requests' rows in one buffer per layer, each row its own sequence.

Row ``b`` holds ``lengths[b]`` tokens in slots ``[0, lengths[b])``; slot ``j`` holds the
token at position ``starts[b] + j`` (``starts`` is non-zero only for a sliding-window row
that joined holding just its window). Rows advance together (every forward writes the same
number of tokens to each row, a shorter draft padded) and roll back apart
(:meth:`BatchKVCache.trim`), so a verify window with ragged acceptance needs no copy: the
slots past a row's length are stale and its mask never shows them.

Architectures use a batch cache exactly as a single one: ``offset`` (an ``int32 [B]`` array
of next positions, which RoPE takes per row), ``update_and_fetch`` and ``mask``. A
sliding-window layer's rows keep everything since they joined and the mask bounds the
window, so rollback never runs into an evicted token.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from foretell.model.kvcache import KVCache, RotatingKVCache, SlidingKVCache


def _capacity(tokens: int, step: int) -> int:
    return max(step, -(-tokens // step) * step)


class BatchKVCache:
    """One layer's keys and values for a batch of rows (see the module docstring).

    Keys and values are each kept as parts: one array, or for quantized KV (``bits``) the
    packed words, scales and biases that :func:`mx.quantize` makes; every part runs along
    the token axis alike, so rows, slots and trims treat them the same."""

    step = 256

    def __init__(self, window: int | None = None, *, bits: int | None = None,
                 group_size: int = 64) -> None:
        if window is not None and window < 1:
            raise ValueError(f"BatchKVCache window must be positive, got {window}")
        self.window = window
        self.bits, self.group_size = bits, group_size
        self._k: tuple[mx.array, ...] | None = None
        self._v: tuple[mx.array, ...] | None = None
        self.starts: list[int] = []
        self.lengths: list[int] = []
        # ``lengths`` and the next positions on the device, advanced there by each update:
        # made from the host lists only after rows join, leave or roll back (on a GPU an
        # array made from host data per layer per step cost more than the layer's work).
        self._device: tuple[mx.array, mx.array] | None = None

    # -- what an architecture calls ------------------------------------------------------

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def offset(self) -> mx.array:
        """Each row's next position, ``int32 [B]`` (RoPE's per-row offset)."""
        return self._arrays()[1]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Write ``n`` new tokens after each row's last and return the slots every row's
        queries may need (``[B, kv_heads, max(lengths) + n, dim]``, or quantized triples)."""
        if keys.shape[0] != self.rows:
            raise ValueError(f"BatchKVCache holds {self.rows} rows, got keys for {keys.shape[0]}")
        n = keys.shape[2]
        end = max(self.lengths) + n
        new_k, new_v = self._parts(keys), self._parts(values)
        self._ensure(end, new_k, new_v)
        if len(set(self.lengths)) == 1:
            start = self.lengths[0]
            for stored, new in zip((*self._k, *self._v), (*new_k, *new_v)):
                stored[..., start : start + n, :] = new
        else:
            # One scatter along the token axis per part: advanced indexing (rows and slots)
            # built about ten graph nodes per part, and a step over ragged rows pays it per layer.
            slots = self._arrays()[0][:, None, None, None]
            if n > 1:
                slots = slots + mx.arange(n)[:, None]
            self._k, self._v = (
                tuple(mx.put_along_axis(x, slots, part, axis=2) for x, part in zip(stored, new))
                for stored, new in ((self._k, new_k), (self._v, new_v)))
        self.lengths = [length + n for length in self.lengths]
        self._advance(n)
        return self._fetch(self._k, end), self._fetch(self._v, end)

    def mask(self, n_queries: int) -> mx.array | None:
        """``bool [B, 1, n_queries, max(lengths) + n_queries]`` for the next update: row
        ``b``'s query ``i`` sits at slot ``lengths[b] + i`` and may read slot ``j <=`` that,
        within the window. None when one query may read every slot (rows of one length, no
        window in reach)."""
        width = max(self.lengths) + n_queries
        uniform = len(set(self.lengths)) == 1
        if n_queries == 1 and uniform and (self.window is None or width <= self.window):
            return None
        lengths = self._arrays()[0][:, None, None]
        query = lengths + mx.arange(n_queries)[None, :, None]
        slot = mx.arange(width)[None, None, :]
        mask = slot <= query
        if self.window is not None:
            mask = mask & (query - slot < self.window)
        return mask[:, None]

    # -- rows joining, leaving and rolling back ------------------------------------------

    def trim(self, counts: Sequence[int]) -> None:
        """Drop the newest ``counts[b]`` tokens of each row ``b`` (a verify window's
        rejected drafts); rows of one batch may hold different lengths per layer, so
        rollback is by count."""
        if len(counts) != self.rows or any(
                not 0 <= n <= length for n, length in zip(counts, self.lengths)):
            raise ValueError(f"cannot trim {list(counts)} tokens from rows of {self.lengths}")
        self.lengths = [length - n for length, n in zip(self.lengths, counts)]
        self._device = None

    def append(self, caches: Sequence[Any]) -> None:
        """Add one row per single-request cache (``KVCache``, ``QuantizedKVCache``,
        ``RotatingKVCache`` or ``SlidingKVCache`` of batch 1, or None for an empty row);
        their arrays are copied in, so the donors stay as they were."""
        states = [self._row_state(cache) for cache in caches]
        filled = [(k, v) for _, k, v in states if k is not None]
        like = (self._k, self._v) if self._k is not None else (filled[0] if filled else None)
        if like is not None:
            capacity = self._make_room(
                max([0, *self.lengths, *(k[0].shape[2] for k, _ in filled)]), like)
            old = (self._k, self._v) if self._k is not None else ((), ())
            joined = []
            for which in (0, 1):
                parts = []
                for i, part in enumerate(like[which]):
                    rows = [_row_buffer(None if (k, v)[which] is None else (k, v)[which][i],
                                        part, capacity) for _, k, v in states]
                    parts.append(mx.concatenate([*old[which][i : i + 1], *rows], axis=0))
                joined.append(tuple(parts))
            self._k, self._v = joined
        self.starts += [start for start, _, _ in states]
        self.lengths += [0 if keys is None else keys[0].shape[2] for _, keys, _ in states]
        self._device = None

    def merge(self, other: BatchKVCache) -> None:
        """Add every row of ``other`` (a batch cache of this layer's kind), after these: one
        pad and one concatenation per part, where :meth:`append` of its rows one by one
        takes three operations a row (on a GPU each is a kernel launched from the host)."""
        if (other.window, other.bits, other.group_size) != (self.window, self.bits,
                                                            self.group_size):
            raise ValueError("cannot merge batch caches of different windows or KV bits")
        if other._k is None or not other.rows:
            if any(other.starts):
                raise ValueError("cannot merge rows that hold no tokens past their start")
            self.append([None] * other.rows)
            return
        theirs = (other._k, other._v)
        capacity = self._make_room(max([0, *self.lengths, *other.lengths]), theirs)

        def fit(x: mx.array, like: mx.array | None) -> mx.array:
            have = x.shape[2]  # a row's slots past its length are stale: never read
            x = x[..., :capacity, :] if have >= capacity else mx.pad(
                x, [(0, 0), (0, 0), (0, capacity - have), (0, 0)])
            return x if like is None else x.astype(like.dtype)

        ours = (self._k, self._v) if self._k is not None else (None, None)
        self._k, self._v = (
            tuple(fit(x, None) if mine is None else mx.concatenate([mine[i], fit(x, mine[i])])
                  for i, x in enumerate(parts))
            for mine, parts in zip(ours, theirs))
        self.starts += other.starts
        self.lengths += other.lengths
        self._device = None

    def _make_room(self, longest: int, like: tuple[tuple[mx.array, ...], ...]) -> int:
        """Buffers of room for ``longest`` tokens a row, the slots of rows that joined
        empty made now (shaped as ``like``'s keys and values parts); returns the capacity.
        Never below the buffers' own: rolled-back drafts and fixed-shape forwards (whole
        capacity steps) leave more slots than the longest row needs."""
        capacity = max(_capacity(longest, self.step),
                       self._k[0].shape[2] if self._k is not None else 0)
        self._resize(capacity)
        if self._k is None and self.rows:
            self._k, self._v = (tuple(mx.zeros((self.rows, x.shape[1], capacity, x.shape[3]),
                                               x.dtype) for x in parts) for parts in like)
        return capacity

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (indices, in the new order)."""
        keep = list(keep)
        self.starts = [self.starts[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        self._device = None
        if self._k is None:
            return
        if not keep:
            self._k = self._v = None
            return
        index = mx.array(keep, dtype=mx.int32)
        width = _capacity(max(self.lengths), self.step)
        self._k, self._v = (tuple(mx.take(x, index, axis=0)[..., :width, :] for x in parts)
                            for parts in (self._k, self._v))

    def extract(self, row: int) -> Any:
        """Row ``row`` as a single-request cache holding exactly its tokens (a copy): a
        ``KVCache`` (quantized with ``bits``), or for a sliding-window layer a
        ``RotatingKVCache`` of its newest window, as the model's ``make_caches`` (and
        ``kv_bits``) would have built them."""
        length, start = self.lengths[row], self.starts[row]
        if self._k is None or length == 0:
            if start:
                raise ValueError(f"row {row} holds no tokens past position {start}")
            keys = values = None
        else:
            keys, values = (tuple(mx.array(x[row : row + 1, :, :length, :]) for x in parts)
                            for parts in (self._k, self._v))
        if self.bits is not None:
            from foretell.cache.quantized import QuantizedKVCache

            state = () if keys is None else (*keys, *values)
            return QuantizedKVCache.from_state(state, {"offset": length, "bits": self.bits,
                                                       "group_size": self.group_size})
        keys, values = (None, None) if keys is None else (keys[0], values[0])
        if self.window is None:
            cache = KVCache()
            cache.state = () if keys is None else (keys, values)
            return cache
        offset = start + length
        if keys is None:
            return RotatingKVCache(self.window)
        kept = min(length, self.window)
        keys, values = keys[..., length - kept :, :], values[..., length - kept :, :]
        if offset > self.window and kept < self.window:
            # Joined holding window - 1 tokens: only a reserve cache can say so.
            sliding = SlidingKVCache(self.window)
            sliding.keys, sliding.values, sliding.held, sliding.offset = keys, values, kept, offset
            return sliding
        ring = RotatingKVCache(self.window)
        ring.state = (keys, values)
        ring.meta = {"offset": offset, "max_size": self.window,
                     "write": offset % self.window if offset < self.window else 0}
        return ring

    # -- whole buffers, for the fixed-shape forwards (foretell.model.fixed) ----------------

    @property
    def buffers(self) -> tuple[mx.array, mx.array] | None:
        """The whole key and value buffers (every slot, written or not), or None while there
        are none or they hold quantized parts."""
        if self._k is None or self.bits is not None:
            return None
        return self._k[0], self._v[0]

    def reserve(self, tokens: int, step: int) -> None:
        """Buffers of at least ``tokens`` slots and a whole multiple of ``step`` (a
        fixed-shape forward traces once per capacity), also where updates grew them by
        :attr:`step`; every row keeps its tokens. Needs buffers already."""
        have = self._k[0].shape[2]
        self._resize(-(-max(tokens, have) // step) * step)

    def written(self, keys: mx.array, values: mx.array, n: int) -> None:
        """The buffers are now ``keys`` and ``values``, which hold ``n`` new tokens after
        every row's last (what :meth:`update_and_fetch` would have left)."""
        self._k, self._v = (keys,), (values,)
        self.lengths = [length + n for length in self.lengths]
        self._advance(n)

    @property
    def nbytes(self) -> int:
        return 0 if self._k is None else sum(x.nbytes for x in (*self._k, *self._v))

    # -- internals -----------------------------------------------------------------------

    def _arrays(self) -> tuple[mx.array, mx.array]:
        """``(lengths, next positions)`` as ``int32 [B]`` device arrays: one array while no
        row starts past position 0, so a step advances one array per layer, not two."""
        if self._device is None:
            lengths = mx.array(self.lengths, dtype=mx.int32)
            self._device = (lengths, lengths + mx.array(self.starts, dtype=mx.int32)
                            if any(self.starts) else lengths)
        return self._device

    def _advance(self, n: int) -> None:
        if self._device is not None:
            lengths, positions = self._device
            advanced = lengths + n
            self._device = (advanced, advanced if positions is lengths else positions + n)

    def _parts(self, x: mx.array) -> tuple[mx.array, ...]:
        if self.bits is None:
            return (x,)
        if x.shape[-1] % self.group_size:
            from foretell.errors import GenerationError

            raise GenerationError(f"kv bits {self.bits}: head_dim {x.shape[-1]} is not a "
                                  f"multiple of the group size {self.group_size}")
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def _fetch(self, parts: tuple[mx.array, ...], end: int) -> Any:
        fetched = tuple(x[..., :end, :] for x in parts)
        return fetched if self.bits is not None else fetched[0]

    def _row_state(self, cache: Any) -> tuple[int, Any, Any]:
        if cache is not None and self.bits is not None and cache.keys is not None \
                and isinstance(cache.keys, tuple):
            state = cache.state
            return (0, tuple(state[:3]), tuple(state[3:])) if state else (0, None, None)
        start, keys, values = _row_state(cache)
        if keys is None:
            return start, None, None
        return start, self._parts(keys), self._parts(values)

    def _ensure(self, end: int, like_k: tuple[mx.array, ...],
                like_v: tuple[mx.array, ...]) -> None:
        if self._k is None:
            capacity = _capacity(end, self.step)
            self._k, self._v = (tuple(mx.zeros((x.shape[0], x.shape[1], capacity, x.shape[3]),
                                               x.dtype) for x in like)
                                for like in (like_k, like_v))
        elif end > self._k[0].shape[2]:
            self._resize(_capacity(end, self.step))

    def _resize(self, capacity: int) -> None:
        """Pad the buffers with zero slots to ``capacity`` (none when there are none)."""
        if self._k is None or self._k[0].shape[2] >= capacity:
            return
        have = self._k[0].shape[2]

        def pad(x: mx.array) -> mx.array:
            B, heads, _, dim = x.shape
            return mx.concatenate([x, mx.zeros((B, heads, capacity - have, dim), x.dtype)], axis=2)

        self._k, self._v = (tuple(pad(x) for x in parts) for parts in (self._k, self._v))


def _row_buffer(x: mx.array | None, like: mx.array, capacity: int) -> mx.array:
    """One row of ``capacity`` slots shaped like ``like``'s, holding ``x`` first."""
    row = mx.zeros((1, like.shape[1], capacity, like.shape[3]), like.dtype)
    if x is not None and x.shape[2]:
        row[..., : x.shape[2], :] = x.astype(like.dtype)
    return row


def _row_state(cache: Any) -> tuple[int, mx.array | None, mx.array | None]:
    """``(start, keys, values)`` of a batch-1 cache, its tokens in time order."""
    if cache is None:
        return 0, None, None
    if isinstance(cache, KVCache):
        state = cache.state
        return (0, *state) if state else (0, None, None)
    if isinstance(cache, RotatingKVCache):
        state = cache.ordered_state()
        if not state:
            return cache.offset, None, None
        return cache.offset - state[0].shape[2], *state
    if isinstance(cache, SlidingKVCache):
        if cache.keys is None or cache.held == 0:
            return cache.offset, None, None
        held = cache.held
        return (cache.offset - held, cache.keys[..., :held, :], cache.values[..., :held, :])
    raise TypeError(f"a batch cannot take a row of {type(cache).__name__} "
                    "(full-attention and sliding-window KV caches only)")


def batch_caches(model: Any, *, bits: int | None = None,
                 group_size: int = 64) -> list[Any]:
    """Empty batch caches, one per layer of ``model``, with each layer's window; with
    ``bits``, full-attention layers hold their KV quantized (sliding-window layers stay
    unquantized, as a single request's do). A model whose caches are not core's builds its
    own (its optional ``make_batch_caches``, see :class:`~foretell.model.contract.Model`)."""
    own = getattr(model, "make_batch_caches", None)
    if own is not None:
        return own(bits=bits, group_size=group_size)
    caches = []
    for cache in model.make_caches():
        window = getattr(cache, "max_size", None)
        if not isinstance(cache, (KVCache, RotatingKVCache, SlidingKVCache)):
            raise TypeError(f"{model.model_type}: a batch cannot hold a "
                            f"{type(cache).__name__} layer")
        caches.append(BatchKVCache(window, bits=bits if window is None else None,
                                   group_size=group_size))
    return caches


class SoloCache:
    """One request's own cache of a layer as a batch of that one row, for a model whose
    caches no batch holds (:func:`batch_caches` raises ``TypeError``): the scheduler then
    runs such a model's requests one after another through the same step. Anything else
    is the wrapped cache's. The scheduler also runs a request alone this way to speculate
    where the model's batch cannot roll rows back apart (recurrent layers): its own caches
    can (an adapted model's journal)."""

    def __init__(self) -> None:
        self.cache: Any = None

    def __getattr__(self, name: str) -> Any:  # nbytes, state ...
        cache = self.__dict__.get("cache")
        if cache is None:
            raise AttributeError(name)
        return getattr(cache, name)

    @property
    def rows(self) -> int:
        return 0 if self.cache is None else 1

    @property
    def trims_rows(self) -> bool:
        """Whether the row could still roll back a round of the longest draft."""
        stays = getattr(self.cache, "stays_trimmable", None)
        return stays is not None and stays(17)

    def append(self, caches: Sequence[Any]) -> None:
        if self.cache is not None or len(caches) != 1:
            raise ValueError("a solo batch holds one row")
        self.cache = caches[0]

    def filter(self, keep: Sequence[int]) -> None:
        if not keep:
            self.cache = None

    def extract(self, row: int) -> Any:
        return self.cache

    def trim(self, counts: Sequence[int]) -> None:
        if counts[0]:
            self.cache.trim(counts[0])


def layer_caches(caches: Sequence[Any]) -> list[Any]:
    """The caches a model's forward takes for a batch: a solo batch's own caches, as they
    are (a model may look at their types), any other batch's as they are."""
    return [c.cache if type(c) is SoloCache else c for c in caches]


def batches(model: Any) -> tuple[bool, bool]:
    """Whether a batch can hold ``model``'s caches (:func:`batch_caches` does not refuse),
    and whether it can roll its rows back apart (a verify round's ragged acceptance)."""
    try:
        caches = batch_caches(model)
    except TypeError:
        return False, False
    return True, all(getattr(c, "trims_rows", True) for c in caches)


def default_kv_budget() -> int:
    """Live KV bytes the scheduler admits up to by default: 40% of the device's memory
    (the physical RAM where MLX does not say), leaving the rest to weights and activations."""
    total = 0
    try:
        total = int(mx.device_info().get("memory_size", 0))
    except Exception:  # noqa: BLE001 - an older MLX without device_info
        total = 0
    if not total:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total * 0.4)
