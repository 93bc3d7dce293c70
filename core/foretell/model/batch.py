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

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from foretell.model.kvcache import KVCache, RotatingKVCache, SlidingKVCache


def _capacity(tokens: int, step: int) -> int:
    return max(step, -(-tokens // step) * step)


class BatchKVCache:
    """One layer's keys and values for a batch of rows (see the module docstring)."""

    step = 256

    def __init__(self, window: int | None = None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"BatchKVCache window must be positive, got {window}")
        self.window = window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.starts: list[int] = []
        self.lengths: list[int] = []

    # -- what an architecture calls ------------------------------------------------------

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def offset(self) -> mx.array:
        """Each row's next position, ``int32 [B]`` (RoPE's per-row offset)."""
        return mx.array([s + n for s, n in zip(self.starts, self.lengths)], dtype=mx.int32)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``n`` new tokens after each row's last and return the slots every row's
        queries may need (``[B, kv_heads, max(lengths) + n, dim]``)."""
        if keys.shape[0] != self.rows:
            raise ValueError(f"BatchKVCache holds {self.rows} rows, got keys for {keys.shape[0]}")
        n = keys.shape[2]
        end = max(self.lengths) + n
        self._ensure(end, keys)
        if len(set(self.lengths)) == 1:
            start = self.lengths[0]
            self.keys[..., start : start + n, :] = keys
            self.values[..., start : start + n, :] = values
        else:
            rows = mx.arange(self.rows)[:, None]
            slots = mx.array(self.lengths, dtype=mx.int32)[:, None] + mx.arange(n)[None]
            # Advanced indices around a slice put their dims first: [B, n, heads, dim].
            self.keys[rows, :, slots] = keys.swapaxes(1, 2)
            self.values[rows, :, slots] = values.swapaxes(1, 2)
        self.lengths = [length + n for length in self.lengths]
        return self.keys[..., :end, :], self.values[..., :end, :]

    def mask(self, n_queries: int) -> mx.array | None:
        """``bool [B, 1, n_queries, max(lengths) + n_queries]`` for the next update: row
        ``b``'s query ``i`` sits at slot ``lengths[b] + i`` and may read slot ``j <=`` that,
        within the window. None when one query may read every slot (rows of one length, no
        window in reach)."""
        lengths = mx.array(self.lengths, dtype=mx.int32)[:, None, None]
        width = max(self.lengths) + n_queries
        uniform = len(set(self.lengths)) == 1
        if n_queries == 1 and uniform and (self.window is None or width <= self.window):
            return None
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

    def append(self, caches: Sequence[Any]) -> None:
        """Add one row per single-request cache (``KVCache``, ``RotatingKVCache`` or
        ``SlidingKVCache`` of batch 1, or None for an empty row); their arrays are copied in,
        so the donors stay as they were."""
        states = [_row_state(cache) for cache in caches]
        filled = [(k, v) for _, k, v in states if k is not None]
        like = (self.keys, self.values) if self.keys is not None else (filled[0] if filled else None)
        if like is not None:
            longest = max([0, *self.lengths, *(k.shape[2] for k, _ in filled)])
            capacity = _capacity(longest, self.step)
            old_keys, old_values = self._resized(capacity)
            rows_k = [_row_buffer(k, like[0], capacity) for _, k, _ in states]
            rows_v = [_row_buffer(v, like[1], capacity) for _, _, v in states]
            self.keys = mx.concatenate([*old_keys, *rows_k], axis=0)
            self.values = mx.concatenate([*old_values, *rows_v], axis=0)
        self.starts += [start for start, _, _ in states]
        self.lengths += [0 if keys is None else keys.shape[2] for _, keys, _ in states]

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (indices, in the new order)."""
        keep = list(keep)
        self.starts = [self.starts[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        if self.keys is None:
            return
        if not keep:
            self.keys = self.values = None
            return
        index = mx.array(keep, dtype=mx.int32)
        width = _capacity(max(self.lengths), self.step)
        self.keys = mx.take(self.keys, index, axis=0)[..., :width, :]
        self.values = mx.take(self.values, index, axis=0)[..., :width, :]

    def extract(self, row: int) -> Any:
        """Row ``row`` as a single-request cache holding exactly its tokens (a copy): a
        ``KVCache``, or for a sliding-window layer a ``RotatingKVCache`` of its newest
        window, as the model's own ``make_caches`` would have built them."""
        length, start = self.lengths[row], self.starts[row]
        if self.keys is None or length == 0:
            if start:
                raise ValueError(f"row {row} holds no tokens past position {start}")
            keys = values = None
        else:
            keys = mx.array(self.keys[row : row + 1, :, :length, :])
            values = mx.array(self.values[row : row + 1, :, :length, :])
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

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    # -- internals -----------------------------------------------------------------------

    def _ensure(self, end: int, like: mx.array) -> None:
        if self.keys is None:
            B, heads, _, dim = like.shape
            capacity = _capacity(end, self.step)
            self.keys = mx.zeros((B, heads, capacity, dim), like.dtype)
            self.values = mx.zeros((B, heads, capacity, dim), like.dtype)
        elif end > self.keys.shape[2]:
            old_keys, old_values = self._resized(_capacity(end, self.step))
            self.keys, self.values = old_keys[0], old_values[0]

    def _resized(self, capacity: int) -> tuple[list[mx.array], list[mx.array]]:
        """The current buffers, padded with zero slots to ``capacity`` (as one-item lists,
        empty when there are none)."""
        if self.keys is None:
            return [], []
        have = self.keys.shape[2]
        if have >= capacity:
            return [self.keys], [self.values]

        def pad(x: mx.array) -> mx.array:
            B, heads, _, dim = x.shape
            return mx.concatenate([x, mx.zeros((B, heads, capacity - have, dim), x.dtype)], axis=2)

        return [pad(self.keys)], [pad(self.values)]



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


def batch_caches(model: Any) -> list[BatchKVCache]:
    """Empty batch caches, one per layer of ``model``, with each layer's window."""
    caches = []
    for cache in model.make_caches():
        window = getattr(cache, "max_size", None)
        if not isinstance(cache, (KVCache, RotatingKVCache, SlidingKVCache)):
            raise TypeError(f"{model.model_type}: a batch cannot hold a "
                            f"{type(cache).__name__} layer")
        caches.append(BatchKVCache(window))
    return caches
