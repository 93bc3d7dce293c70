"""An adapted model's batch caches: foretell's batch-cache interface over mlx-lm's own.

mlx-lm batches a layer by merging the rows' single caches into its batch kind (``KVCache``
into ``BatchKVCache``, ``RotatingKVCache`` into ``BatchRotatingKVCache``, an ``ArraysCache``
stacks the rows' recurrent state, a ``CacheList`` merges each part), rows left-padded to
one shared write position; its ``BatchGenerator`` joins rows with ``merge`` and ``extend``,
drops them with ``filter`` and takes them out with ``extract``. A :class:`BatchLayer` keeps
one such cache per layer and speaks foretell's interface (:mod:`foretell.model.batch`): rows
join as adapted single caches, leave by index, and come out as the adapted caches the
model's ``make_caches`` builds; an adapted model's ``forward`` hands mlx-lm the caches inside.

Rolling rows back apart (a verify window's ragged acceptance): a left-padded KV layer drops a
row's newest ``n`` tokens by moving its slots ``n`` to the right, so the dropped ones wrap into
the row's padding, which the mask hides. Any other kind rolls back only all rows alike (a
ring before it wraps) or not at all (recurrent state): a batch holding one says
``trims_rows = False``, and the scheduler decodes its rows plainly, never drafting for them.
A layer kind mlx-lm cannot merge is refused by :func:`batch_caches`, naming the model type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as lm

from foretell.errors import GenerationError
from foretell_mlxlm.caches import adapted_class, base_class, flat_arrays

#: mlx-lm modules whose own code computes otherwise, or fails, with rows of different
#: lengths in one batch (mlx-lm 0.32.2; a test shows each reason still holds).
UNBATCHED = {
    "afm7": "its KV-reuse layers place every row's queries at the batch buffer's length, "
            "not at the row's own position",
    "gemma2": "its attention reshapes queries by key-value head, and a batch's per-row "
              "mask does not broadcast against those scores",
    "phi3small": "its block-sparse attention's scores do not broadcast against a batch's "
                 "per-row mask",
    "gpt_bigcode": "its position ids are read from one offset for every row",
    "recurrent_gemma": "its recurrence scales a sequence's first token otherwise when it "
                       "holds no state, and a row joining with none (a one-token prompt) "
                       "holds zeros beside rows that hold some",
}


def batch_caches(model: Any) -> list[BatchLayer]:
    """Empty batch caches for ``model``'s layers (its ``make_batch_caches``).

    :raises TypeError: a layer's cache kind mlx-lm cannot merge into a batch (chunked or
        quantized attention, a ring that keeps leading tokens), or a module of
        :data:`UNBATCHED`, naming the model type."""
    from mlx_lm.models.cache import make_prompt_cache

    for module in _modules(model):
        if module in UNBATCHED:
            raise TypeError(f"{model.model_type}: a batch cannot hold this model: mlx-lm's "
                            f"models/{module}.py {UNBATCHED[module]}")
    singles = make_prompt_cache(model)
    journaled = any(type(c) is not lm.KVCache for c in singles)
    for cache in singles:
        if not _mergeable(cache):
            name = adapted_class(type(cache), journaled).__name__
            raise TypeError(f"{model.model_type}: a batch cannot hold a {name} layer "
                            "(mlx-lm cannot merge it into a batch)")
    trims_rows = all(_trims_rows(c) for c in singles)

    def single(layer: int) -> Callable[[], Any]:
        def make() -> Any:
            made = make_prompt_cache(model)[layer]
            made.__class__ = adapted_class(type(made), journaled)
            return made
        return make

    return [BatchLayer(single(layer), journaled, trims_rows) for layer in range(len(singles))]


def _modules(model: Any) -> set[str]:
    """The ``mlx_lm.models`` modules whose classes make up ``model`` (a wrapper's text
    model's too)."""
    found = set()
    for module in model.modules():
        found.update(k.__module__.rpartition(".")[2] for k in type(module).__mro__
                     if k.__module__.startswith("mlx_lm.models."))
    return found


def _mergeable(cache: Any) -> bool:
    if isinstance(cache, lm.CacheList):
        return all(_mergeable(c) for c in cache.caches)
    if isinstance(cache, lm.RotatingKVCache) and cache.keep:
        return False  # mlx-lm's batch ring keeps no leading tokens
    # Exact kinds: a subclass's own behaviour would be lost in the batch kind merged to.
    return type(cache) in (lm.KVCache, lm.RotatingKVCache, lm.ArraysCache)


def _trims_rows(cache: Any) -> bool:
    if isinstance(cache, lm.CacheList):
        return all(_trims_rows(c) for c in cache.caches)
    return base_class(cache) is lm.KVCache


class BatchLayer:
    """One layer of an adapted model's batch (see the module docstring): mlx-lm's batch
    cache of the rows (``cache``, None while there are none) and each row's token count."""

    def __init__(self, make_single: Callable[[], Any], journaled: bool,
                 trims_rows: bool) -> None:
        self._make_single = make_single
        self._journaled = journaled
        #: Whether rows roll back by different counts: the same on every layer of a batch
        #: (False where any layer cannot), so the scheduler reads one.
        self.trims_rows = trims_rows
        self.cache: Any = None
        self.lengths: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def took(self, n: int) -> None:
        """A forward wrote ``n`` tokens to every row."""
        self.lengths = [length + n for length in self.lengths]

    def append(self, caches: Sequence[Any]) -> None:
        """Add one row per adapted single cache (None: an empty row); mlx-lm's merge copies
        their arrays, so the donors stay as they were."""
        singles = [c if c is not None else self._make_single() for c in caches]
        if not singles:
            return
        merged = _merge(singles)
        if self.cache is None:
            self.cache = merged
        else:
            self.cache.extend(merged)
        self.lengths += [int(c.offset) for c in singles]

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (indices, in the new order)."""
        keep = list(keep)
        self.lengths = [self.lengths[i] for i in keep]
        if not keep:
            self.cache = None
        elif self.cache is not None:
            self.cache.filter(mx.array(keep, dtype=mx.int32))

    def extract(self, row: int) -> Any:
        """Row ``row`` as the adapted single cache ``make_caches`` builds, holding exactly its
        tokens (a copy)."""
        length = self.lengths[row]
        if _unwritten(self.cache):
            single = self._make_single()  # a layer that never writes its KV still counts
            single.offset = length
            return single
        single = self.cache.extract(row)
        single.__class__ = adapted_class(type(single), self._journaled)
        if single.counted:
            single._seen = length
        return single

    def trim(self, counts: Sequence[int]) -> None:
        """Drop the newest ``counts[b]`` tokens of each row ``b``: by row where
        :attr:`trims_rows`, else only all rows alike and only where mlx-lm's cache can.

        :raises GenerationError: the layer cannot drop these counts."""
        counts = list(counts)
        if len(counts) != self.rows or any(
                not 0 <= n <= length for n, length in zip(counts, self.lengths)):
            raise ValueError(f"cannot trim {counts} tokens from rows of {self.lengths}")
        if not any(counts):
            return
        if not self.trims_rows and (len(set(counts)) > 1 or not self.cache.is_trimmable()):
            raise GenerationError(f"an mlx-lm {type(self.cache).__name__} cannot drop "
                                  f"{counts} tokens from its rows: rows roll back apart only "
                                  "in a batch of plain KV layers, others drop tokens from all "
                                  "rows alike where mlx-lm can (a ring before it wraps, never "
                                  "recurrent state)")
        self.lengths = [length - n for length, n in zip(self.lengths, counts)]
        _trim(self.cache, counts, max(self.lengths))

    @property
    def nbytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes

    @property
    def state(self) -> tuple[mx.array, ...]:
        """The arrays the batch holds (what an ``mx.eval`` of the batch needs)."""
        return () if self.cache is None else tuple(flat_arrays(self.cache.state))


def _unwritten(cache: Any) -> bool:
    """A batch KV cache its layer never writes (attention replaced by a linear map)."""
    return isinstance(cache, lm.BatchKVCache) and cache.keys is None


def _merge(singles: list[Any]) -> Any:
    """mlx-lm's batch cache of ``singles`` (one layer of several rows)."""
    base = base_class(singles[0])
    if base is lm.KVCache and all(c.keys is None for c in singles):
        # mlx-lm merges by each row's size, which for a layer that never writes is its
        # token count with no keys behind it.
        return lm.BatchKVCache([0] * len(singles))
    return base.merge(singles)


def _trim(cache: Any, counts: list[int], longest: int) -> None:
    if isinstance(cache, lm.CacheList):
        for part in cache.caches:
            _trim(part, counts, longest)
    elif isinstance(cache, lm.BatchKVCache):
        if cache.keys is not None:
            _trim_kv_rows(cache, counts, longest)
    else:
        cache.trim(counts[0])


def _trim_kv_rows(cache: lm.BatchKVCache, counts: list[int], longest: int) -> None:
    """Drop ``counts[b]`` tokens of each row of a left-padded KV cache (``longest``: the most
    any row holds after): every row the fewest by mlx-lm's own trim, then each row's rest by
    shifting its slots right by it (mlx-lm's ``finalize`` does this for right-padded
    prompts): the dropped slots wrap into the row's padding, which grows by as much."""
    least = min(counts)
    if least:
        cache.trim(least)
    rest = [n - least for n in counts]
    if not any(rest):
        return
    shift = mx.array(rest, dtype=mx.int32)
    end = cache._idx
    for name in ("keys", "values"):
        buffer = getattr(cache, name)
        buffer[..., :end, :] = lm.dynamic_roll(buffer[..., :end, :], shift[:, None], axis=2)
    cache.left_padding = cache.left_padding + shift
    cache.offset = cache.offset - shift
    # Slots every row pads (rows trimming most in turn leave them) are dropped, as mlx-lm's
    # filter drops them, so the buffer stays as wide as the longest row.
    waste = end - longest
    if waste > 0:
        cache.keys, cache.values = cache.keys[..., waste:, :], cache.values[..., waste:, :]
        cache._idx -= waste
        cache.left_padding = cache.left_padding - waste
