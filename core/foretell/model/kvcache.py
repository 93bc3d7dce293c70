"""Per-layer KV caches: the growable :class:`KVCache` (full attention) and the
sliding-window :class:`RotatingKVCache`.

Both keep ``[B, kv_heads, slots, head_dim]`` buffers preallocated in ``step``-token
chunks and write new tokens into them in place, so a decode step never copies the
history. ``offset`` counts every token the layer has seen (it is also the RoPE position
of the next token).

Codecs read and restore a cache through ``state`` (the key/value arrays) and ``meta``
(small JSON-able numbers); ``from_state(state, meta)`` rebuilds one. Arrays handed out
or taken in are fresh views, so a restored cache writing in place never mutates the
donor's arrays (reuse must not change a stored entry).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from foretell.config import engine_choice
from foretell.model.attention import Mask, causal_mask


def _view(x: mx.array, stop: int) -> mx.array:
    return x[..., :stop, :]


def _grow(buffer: mx.array | None, used: int, new: mx.array, capacity: int) -> mx.array:
    """``buffer[..., :used, :]`` followed by zeros, ``capacity`` slots in all."""
    B, heads, _, dim = new.shape
    fresh = mx.zeros((B, heads, capacity - used, dim), new.dtype)
    if buffer is None or used == 0:
        return fresh
    return mx.concatenate([_view(buffer, used), fresh], axis=2)


class KVCache:
    """Keys and values of every token seen; trimmable to any shorter prefix."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start, end = self.offset, self.offset + keys.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            capacity = -(-end // self.step) * self.step
            self.keys = _grow(self.keys, start, keys, capacity)
            self.values = _grow(self.values, start, values, capacity)
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self.offset = end
        if end == self.keys.shape[2]:
            return self.keys, self.values
        return _view(self.keys, end), _view(self.values, end)

    def reserve(self, tokens: int, step: int) -> None:
        """Buffers of at least ``tokens`` slots and a whole multiple of ``step`` (the
        fixed-shape forwards of :mod:`foretell.model.fixed` write into them whole, and
        trace once per capacity), also where :meth:`update_and_fetch` grew them by its own
        smaller steps; the first ``offset`` slots keep their tokens. Needs keys already
        written (their shape)."""
        capacity = -(-max(tokens, self.keys.shape[2]) // step) * step
        if capacity != self.keys.shape[2]:
            self.keys = _grow(self.keys, self.offset, self.keys, capacity)
            self.values = _grow(self.values, self.offset, self.values, capacity)

    def mask(self, n_queries: int) -> Mask:
        return None if n_queries == 1 else "causal"

    def is_trimmable(self) -> bool:
        return True

    def stays_trimmable(self, n: int) -> bool:
        """Whether ``n`` more tokens would still leave the cache trimmable."""
        return True

    def trim(self, n: int) -> int:
        n = max(0, min(self.offset, n))
        self.offset -= n
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    @property
    def state(self) -> tuple[mx.array, ...]:
        """``(keys, values)`` holding exactly ``offset`` tokens; ``()`` when empty."""
        if self.keys is None or self.offset == 0:
            return ()
        return _view(self.keys, self.offset), _view(self.values, self.offset)

    @state.setter
    def state(self, state: tuple[mx.array, ...]) -> None:
        if not state:
            self.keys = self.values = None
            self.offset = 0
            return
        keys, values = state
        self.offset = keys.shape[2]
        self.keys, self.values = _view(keys, self.offset), _view(values, self.offset)

    @property
    def meta(self) -> dict[str, Any]:
        return {"offset": self.offset, "step": self.step}

    @meta.setter
    def meta(self, meta: dict[str, Any]) -> None:
        if int(meta["offset"]) != self.offset:
            raise ValueError(
                f"KVCache meta offset {meta['offset']} does not match the "
                f"{self.offset} tokens in its state"
            )

    @classmethod
    def from_state(cls, state: tuple[mx.array, ...], meta: dict[str, Any]) -> KVCache:
        cache = cls()
        cache.state = state
        cache.meta = meta
        return cache


class RotatingKVCache:
    """The last ``max_size`` tokens of a sliding-window layer, kept in a ring.

    Until ``max_size`` tokens have been seen, slot ``i`` holds position ``i``; after that
    ``_write`` (the next slot to overwrite) holds the oldest token, so slot
    ``(_write + j) % max_size`` holds position ``offset - max_size + j``. For ``L`` new
    tokens attention gets the ``min(offset, max_size - 1)`` tokens before them plus the new
    ones, in time order (one decode token reads the ring as stored), so every token sees
    its full window; :meth:`mask` describes exactly those keys. Once a token has been
    evicted the ring cannot roll back: ``is_trimmable`` turns false.
    """

    step = 256

    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"RotatingKVCache max_size must be positive, got {max_size}")
        self.max_size = max_size
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self._write = 0

    # -- updates -------------------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        if self.offset + n <= self.max_size:
            return self._append(keys, values)
        if n == 1:
            return self._overwrite(keys, values)
        return self._slide(keys, values)

    def _append(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Nothing gets evicted: write in place, growing by ``step`` up to ``max_size``."""
        start, end = self.offset, self.offset + keys.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            capacity = min(self.max_size, -(-end // self.step) * self.step)
            self.keys = _grow(self.keys, start, keys, capacity)
            self.values = _grow(self.values, start, values, capacity)
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self.offset = end
        self._write = end % self.max_size
        if end == self.keys.shape[2]:
            return self.keys, self.values
        return _view(self.keys, end), _view(self.values, end)

    def _overwrite(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """One token into a full ring: replace the oldest slot."""
        slot = self._write
        self.keys[..., slot : slot + 1, :] = keys
        self.values[..., slot : slot + 1, :] = values
        self.offset += 1
        self._write = (slot + 1) % self.max_size
        return self.keys, self.values

    def _slide(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Several tokens that evict: attend over the window before them plus all of
        them, then keep the newest ``max_size`` in time order."""
        all_keys = self._window_before(self.keys, keys)
        all_values = self._window_before(self.values, values)
        self.keys = all_keys[..., -self.max_size :, :]
        self.values = all_values[..., -self.max_size :, :]
        self.offset += keys.shape[2]
        self._write = 0
        return all_keys, all_values

    def _window_before(self, stored: mx.array | None, new: mx.array) -> mx.array:
        """The newest ``max_size - 1`` stored tokens (in time order) followed by ``new``."""
        if stored is None or self.offset == 0 or self.max_size == 1:
            return new
        prior = self._in_time_order(stored)
        start = max(0, prior.shape[2] - (self.max_size - 1))
        return mx.concatenate([prior[..., start:, :], new], axis=2)

    def _in_time_order(self, x: mx.array) -> mx.array:
        if self.offset <= self.max_size:
            return _view(x, self.offset)
        if self._write == 0:
            return x
        return mx.concatenate([x[..., self._write :, :], x[..., : self._write, :]], axis=2)

    def mask(self, n_queries: int) -> Mask:
        """Mask for ``n_queries`` new tokens over the keys the next update returns."""
        if n_queries == 1:
            return None
        prior = min(self.offset, self.max_size - 1)
        if prior + n_queries <= self.max_size:
            return "causal"
        return causal_mask(n_queries, prior, self.max_size)

    # -- rollback ------------------------------------------------------------------------

    def is_trimmable(self) -> bool:
        """True until a token has been evicted from the window."""
        return self.offset <= self.max_size

    def stays_trimmable(self, n: int) -> bool:
        """Whether ``n`` more tokens would still leave the cache trimmable: a speculative
        window that would evict must not run on a ring it may need to roll back."""
        return self.offset + n <= self.max_size

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        n = max(0, min(self.offset, n))
        self.offset -= n
        self._write = self.offset % self.max_size
        return n

    # -- inspection and snapshots --------------------------------------------------------

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def ordered_state(self) -> tuple[mx.array, ...]:
        """``(keys, values)`` of the stored tokens, oldest first; ``()`` when empty."""
        if self.keys is None or self.offset == 0:
            return ()
        return self._in_time_order(self.keys), self._in_time_order(self.values)

    @property
    def state(self) -> tuple[mx.array, ...]:
        """``(keys, values)`` of the stored slots as laid out (see ``meta["write"]``)."""
        if self.keys is None or self.offset == 0:
            return ()
        stored = self.size()
        return _view(self.keys, stored), _view(self.values, stored)

    @state.setter
    def state(self, state: tuple[mx.array, ...]) -> None:
        if not state:
            self.keys = self.values = None
            return
        keys, values = state
        stored = keys.shape[2]
        self.keys, self.values = _view(keys, stored), _view(values, stored)

    @property
    def meta(self) -> dict[str, Any]:
        return {
            "offset": self.offset,
            "max_size": self.max_size,
            "write": self._write,
            "step": self.step,
        }

    @meta.setter
    def meta(self, meta: dict[str, Any]) -> None:
        offset, max_size, write = int(meta["offset"]), int(meta["max_size"]), int(meta["write"])
        stored = 0 if self.keys is None else self.keys.shape[2]
        if max_size < 1 or not 0 <= write < max_size or stored != min(offset, max_size):
            raise ValueError(f"RotatingKVCache meta {meta} does not fit a state of {stored} tokens")
        self.offset, self.max_size, self._write = offset, max_size, write

    @classmethod
    def from_state(cls, state: tuple[mx.array, ...], meta: dict[str, Any]) -> RotatingKVCache:
        cache = cls(int(meta["max_size"]))
        cache.state = state
        cache.meta = meta
        return cache


_WINDOW_MODE: str | None = None


def window_copies() -> bool:
    """Whether a :class:`SlidingKVCache` hands attention a copy of its window rather than a
    view into its buffer, whenever the window does not start at the buffer's start.

    On CUDA it must: MLX-CUDA 0.32.4's fused single-token attention misreads a key view that
    starts past its buffer's start (NaN), so a sliding-window model speculating past its
    window computed garbage (docs/decisions.md). The CPU and Metal take the view. An
    engine's ``sliding_window`` setting (``copy``/``view``) forces either for its work;
    ``FORETELL_SLIDING_WINDOW`` is the process's default. Only the cache knows its window
    starts past its buffer's start, so the copy is made here, not in attention.
    ``tests/spec/test_sliding_reserve.py``, run on CUDA, re-checks the kernel after an MLX
    upgrade.
    """
    global _WINDOW_MODE
    chosen = engine_choice("sliding_window")
    if chosen is not None:
        return chosen == "copy"
    if _WINDOW_MODE is None:
        from foretell.platform.device import device_mode

        _WINDOW_MODE = device_mode("FORETELL_SLIDING_WINDOW", cuda="copy", elsewhere="view",
                                   choices=("copy", "view"))
    return _WINDOW_MODE == "copy"


class SlidingKVCache:
    """A sliding-window layer's keys and values that can roll back: the window plus a
    rollback reserve, kept in time order.

    The speculative verifier swaps these in for :class:`RotatingKVCache`
    (:func:`add_rollback_reserve`): a wrapped ring cannot undo rejected drafts (mlx-lm
    #1914, #118). The buffer keeps at least the newest ``window - 1 + reserve`` tokens, so
    up to ``reserve + 1`` new tokens can be trimmed with every later query still seeing its
    whole window; older tokens go by compacting once every ``step`` tokens, never by
    overwriting in place. Attention gets the newest ``min(held, window - 1)`` tokens plus
    the new ones, in time order (:meth:`mask`), as a view or on CUDA a copy
    (:func:`window_copies`).
    """

    step = 256

    def __init__(self, max_size: int, reserve: int = 0) -> None:
        if max_size < 1 or reserve < 0:
            raise ValueError(
                f"SlidingKVCache needs max_size >= 1 and reserve >= 0, got {max_size}, {reserve}"
            )
        self.max_size = max_size
        self.reserve = reserve
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        #: Tokens held, the newest of the sequence, at ``keys[..., :held, :]``.
        self.held = 0

    @classmethod
    def from_ring(cls, ring: RotatingKVCache, reserve: int) -> SlidingKVCache:
        cache = cls(ring.max_size, reserve)
        ordered = ring.ordered_state()
        if ordered:
            cache.keys, cache.values = ordered
            cache.held = ordered[0].shape[2]
        cache.offset = ring.offset
        return cache

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        if self.keys is None or self.held + n > self.keys.shape[2]:
            self._compact(keys)
        start, end = self.held, self.held + keys.shape[2]
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self.held = end
        self.offset += n
        first = start - min(start, self.max_size - 1)
        keys, values = self.keys[..., first:end, :], self.values[..., first:end, :]
        if first and window_copies():
            return mx.contiguous(keys), mx.contiguous(values)
        return keys, values

    def _compact(self, new: mx.array) -> None:
        """Move the tokens still needed to the front of a buffer with room for ``new``."""
        keep = min(self.held, self.max_size - 1 + self.reserve)
        capacity = -(-(keep + new.shape[2]) // self.step) * self.step + self.step
        self.keys = _grow(self._newest(self.keys, keep), keep, new, capacity)
        self.values = _grow(self._newest(self.values, keep), keep, new, capacity)
        self.held = keep

    def _newest(self, buffer: mx.array | None, keep: int) -> mx.array | None:
        if buffer is None or keep == 0:
            return None
        return buffer[..., self.held - keep : self.held, :]

    def mask(self, n_queries: int) -> Mask:
        if n_queries == 1:
            return None
        prior = min(self.held, self.max_size - 1)
        if prior + n_queries <= self.max_size:
            return "causal"
        return causal_mask(n_queries, prior, self.max_size)

    # -- rollback ------------------------------------------------------------------------

    def trimmable(self) -> int:
        """How many of the newest tokens can be dropped with every later window intact."""
        if self.held == self.offset:
            return self.offset
        return max(0, self.held - (self.max_size - 1))

    def is_trimmable(self) -> bool:
        return self.trimmable() > 0 or self.offset == 0

    def stays_trimmable(self, n: int) -> bool:
        """Whether ``n`` more tokens (over one or more updates) could all be trimmed again:
        compaction keeps ``window - 1 + reserve`` older tokens, so rounds of up to
        ``reserve + 1``; any round while nothing has been dropped yet."""
        return n <= self.reserve + 1 or self.offset + n <= self.max_size + self.reserve

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.trimmable()))
        self.held -= n
        self.offset -= n
        return n

    # -- inspection and snapshots --------------------------------------------------------

    def size(self) -> int:
        return self.held

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    @property
    def state(self) -> tuple[mx.array, ...]:
        """``(keys, values)`` of the held tokens, oldest first; ``()`` when empty."""
        if self.keys is None or self.held == 0:
            return ()
        return _view(self.keys, self.held), _view(self.values, self.held)

    @state.setter
    def state(self, state: tuple[mx.array, ...]) -> None:
        if not state:
            self.keys = self.values = None
            self.held = 0
            return
        keys, values = state
        self.held = keys.shape[2]
        self.keys, self.values = _view(keys, self.held), _view(values, self.held)

    @property
    def meta(self) -> dict[str, Any]:
        return {"offset": self.offset, "max_size": self.max_size, "reserve": self.reserve,
                "held": self.held}

    @meta.setter
    def meta(self, meta: dict[str, Any]) -> None:
        offset, held = int(meta["offset"]), int(meta["held"])
        stored = 0 if self.keys is None else self.keys.shape[2]
        if stored != held or held > offset:
            raise ValueError(f"SlidingKVCache meta {meta} does not fit a state of {stored} tokens")
        self.offset, self.held = offset, held
        self.max_size, self.reserve = int(meta["max_size"]), int(meta["reserve"])

    @classmethod
    def from_state(cls, state: tuple[mx.array, ...], meta: dict[str, Any]) -> SlidingKVCache:
        cache = cls(int(meta["max_size"]), int(meta["reserve"]))
        cache.state = state
        cache.meta = meta
        return cache


def add_rollback_reserve(caches: list[Any], reserve: int) -> list[Any]:
    """Let every sliding-window cache in ``caches`` roll back rounds of up to
    ``reserve + 1`` tokens, in place (a ring becomes a :class:`SlidingKVCache` holding the
    same tokens). Other caches are left as they are."""
    for i, cache in enumerate(caches):
        if type(cache) is RotatingKVCache:
            caches[i] = SlidingKVCache.from_ring(cache, reserve)
        elif type(cache) is SlidingKVCache and cache.reserve < reserve:
            cache.reserve = reserve
    return caches


def can_trim(caches: list[Any]) -> bool:
    """Whether every cache of a sequence can roll back exactly."""
    return all(c.is_trimmable() for c in caches)


def stay_trimmable(caches: list[Any], n: int) -> bool:
    """Whether every cache could still roll back after ``n`` more tokens."""
    return all(c.stays_trimmable(n) for c in caches)


def trim_all(caches: list[Any], n: int) -> int:
    """Drop the ``n`` newest tokens from every cache, or from none if any cannot."""
    if not caches or not can_trim(caches):
        return 0
    return [c.trim(n) for c in caches][0]
