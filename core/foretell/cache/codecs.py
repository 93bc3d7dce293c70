"""KV-cache codecs: how one kind of per-layer cache is snapshotted, restored and cloned.

Every stored entry records, per layer, the codec's ``provider_id``; a reader loads a layer
only through the codec with that exact id, so a change to a codec's stored form (bump the
``@N``) can never be misread as the old one. Each cache class has exactly one codec; there
is no parallel ``isinstance`` chain anywhere else.

Zero-copy is safe because MLX arrays are immutable values: a cache's in-place write
rebinds its own array object, and MLX only reuses a buffer in place when nothing else
references it. So a clone and its donor may share buffers, and extending one never changes
the other (DESIGN.md invariant 5).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import mlx.core as mx

from foretell.errors import CodecError
from foretell.model.kvcache import KVCache, RotatingKVCache, SlidingKVCache
from foretell.plugin.registry import Kind, Registry
from foretell.store.entry import Entry, LayerHeader, LayerState

Tensors = dict[str, mx.array]
Meta = dict[str, Any]


class CacheCodec(Protocol):
    """What ``foretell_register_cache_codecs`` factories build (instantiated with no
    arguments). ``meta`` values must be JSON-able; tensors hold only the valid prefix."""

    #: The registered name, e.g. ``"kv"``.
    name: str
    #: Written into every stored layer and checked on load; bump when the stored form changes.
    provider_id: str

    def matches(self, cache: Any) -> bool:
        """Whether this codec handles ``cache`` (exactly one codec may)."""

    def snapshot(self, cache: Any) -> tuple[Tensors, Meta]:
        """The cache's state: tensors (sharing the cache's buffers) and small JSON meta."""

    def load(self, tensors: Mapping[str, mx.array], meta: Mapping[str, Any]) -> Any:
        """A cache rebuilt from a snapshot; it continues exactly like the original."""

    def clone(self, cache: Any) -> Any:
        """A zero-copy copy; extending either one never changes the other."""

    def header_trimmable(self, meta: Mapping[str, Any]) -> bool:
        """Whether a stored layer can be trimmed to a shorter prefix (a wrapped ring cannot)."""

    def minimum_reusable_offset(self, meta: Mapping[str, Any]) -> int:
        """The shortest prefix a stored layer can be trimmed back to and still be exact."""


def _pair(codec: str, tensors: Mapping[str, mx.array]) -> tuple[mx.array, ...]:
    if not tensors:
        return ()
    if set(tensors) != {"keys", "values"}:
        raise CodecError(f"codec '{codec}' expects tensors 'keys' and 'values', got {sorted(tensors)}")
    return tensors["keys"], tensors["values"]


class StandardKVCodec:
    """:class:`~foretell.model.kvcache.KVCache`: keys/values up to ``offset``; always trimmable."""

    name = "kv"
    provider_id = "foretell.baseline/kv@1"

    def matches(self, cache: Any) -> bool:
        # Exact type: a subclass may hold state this codec would silently drop.
        return type(cache) is KVCache

    def snapshot(self, cache: KVCache) -> tuple[Tensors, Meta]:
        state = cache.state  # views of exactly `offset` tokens, not the step slack
        tensors = dict(zip(("keys", "values"), state))
        return tensors, {"offset": cache.offset}

    def load(self, tensors: Mapping[str, mx.array], meta: Mapping[str, Any]) -> KVCache:
        return KVCache.from_state(_pair(self.name, tensors), dict(meta))

    def clone(self, cache: KVCache) -> KVCache:
        return self.load(*self.snapshot(cache))

    def header_trimmable(self, meta: Mapping[str, Any]) -> bool:
        return True

    def minimum_reusable_offset(self, meta: Mapping[str, Any]) -> int:
        return 0


class RotatingKVCodec:
    """:class:`~foretell.model.kvcache.RotatingKVCache`: the stored slots as laid out, plus the
    ring's write index; trimmable only until a token has been evicted."""

    name = "rotating-kv"
    provider_id = "foretell.baseline/rotating-kv@1"

    def matches(self, cache: Any) -> bool:
        return type(cache) is RotatingKVCache

    def snapshot(self, cache: RotatingKVCache) -> tuple[Tensors, Meta]:
        tensors = dict(zip(("keys", "values"), cache.state))
        meta = cache.meta
        return tensors, {"offset": meta["offset"], "max_size": meta["max_size"],
                         "write": meta["write"]}

    def load(self, tensors: Mapping[str, mx.array], meta: Mapping[str, Any]) -> RotatingKVCache:
        return RotatingKVCache.from_state(_pair(self.name, tensors), dict(meta))

    def clone(self, cache: RotatingKVCache) -> RotatingKVCache:
        return self.load(*self.snapshot(cache))

    def header_trimmable(self, meta: Mapping[str, Any]) -> bool:
        # Same rule as RotatingKVCache.is_trimmable: exact until the first eviction.
        return int(meta["offset"]) <= int(meta["max_size"])

    def minimum_reusable_offset(self, meta: Mapping[str, Any]) -> int:
        # A wrapped ring has lost its oldest tokens: it can serve only its exact length.
        return 0 if self.header_trimmable(meta) else int(meta["offset"])


class SlidingKVCodec:
    """:class:`~foretell.model.kvcache.SlidingKVCache` (a sliding window with a rollback reserve,
    what speculation runs sliding-window layers on): the held tokens in time order."""

    name = "sliding-kv"
    provider_id = "foretell.baseline/sliding-kv@1"

    def matches(self, cache: Any) -> bool:
        return type(cache) is SlidingKVCache

    def snapshot(self, cache: SlidingKVCache) -> tuple[Tensors, Meta]:
        return dict(zip(("keys", "values"), cache.state)), cache.meta

    def load(self, tensors: Mapping[str, mx.array], meta: Mapping[str, Any]) -> SlidingKVCache:
        return SlidingKVCache.from_state(_pair(self.name, tensors), dict(meta))

    def clone(self, cache: SlidingKVCache) -> SlidingKVCache:
        return self.load(*self.snapshot(cache))

    def _trimmable(self, meta: Mapping[str, Any]) -> int:
        offset, held, window = int(meta["offset"]), int(meta["held"]), int(meta["max_size"])
        return offset if held == offset else max(0, held - (window - 1))

    def header_trimmable(self, meta: Mapping[str, Any]) -> bool:
        return self._trimmable(meta) > 0

    def minimum_reusable_offset(self, meta: Mapping[str, Any]) -> int:
        return int(meta["offset"]) - self._trimmable(meta)


# -- selecting codecs and applying them to a whole sequence --------------------------------


def codec_for(cache: Any, codecs: Iterable[CacheCodec]) -> CacheCodec:
    """The one codec that handles ``cache``.

    :raises CodecError: none or several do (the message names them).
    """
    codecs = list(codecs)
    found = [c for c in codecs if c.matches(cache)]
    if len(found) == 1:
        return found[0]
    kind = f"{type(cache).__module__}.{type(cache).__qualname__}"
    if not found:
        installed = ", ".join(c.name for c in codecs) or "none"
        raise CodecError(f"no cache codec handles {kind} (installed codecs: {installed}); "
                         "install a plugin that registers one (see `foretell plugins`)")
    raise CodecError(f"{kind} is claimed by several cache codecs: "
                     f"{', '.join(c.name for c in found)}; each cache kind needs exactly one")


def codec_for_provider(provider_id: str, codecs: Iterable[CacheCodec]) -> CacheCodec:
    """The codec that wrote a stored layer.

    :raises CodecError: no loaded codec has that provider id.
    """
    codecs = list(codecs)
    for codec in codecs:
        if codec.provider_id == provider_id:
            return codec
    loaded = ", ".join(c.provider_id for c in codecs) or "none"
    raise CodecError(f"stored cache layer was written by codec provider '{provider_id}', "
                     f"which is not loaded (loaded: {loaded})")


def snapshot_entry(tokens: Sequence[int], caches: Sequence[Any], codecs: Iterable[CacheCodec],
                   namespace: str = "") -> Entry:
    """An :class:`Entry` of every layer's cache after ``tokens``; shares their buffers."""
    codecs = list(codecs)
    layers = []
    for cache in caches:
        codec = codec_for(cache, codecs)
        tensors, meta = codec.snapshot(cache)
        layers.append(LayerState(codec=codec.name, provider=codec.provider_id, meta=meta,
                                 tensors=tensors))
    return Entry(tokens=tokens, layers=layers, namespace=namespace)


def restore_caches(entry: Entry, codecs: Iterable[CacheCodec]) -> list[Any]:
    """Per-layer caches rebuilt from ``entry``, each through the codec that wrote it."""
    codecs = list(codecs)
    return [codec_for_provider(layer.provider, codecs).load(layer.tensors, layer.meta)
            for layer in entry.layers]


def clone_caches(caches: Sequence[Any], codecs: Iterable[CacheCodec]) -> list[Any]:
    """Zero-copy clones of a sequence's caches; the originals are never mutated by them."""
    codecs = list(codecs)
    return [codec_for(cache, codecs).clone(cache) for cache in caches]


def entry_trimmable(layers: Sequence[LayerHeader | LayerState],
                    codecs: Iterable[CacheCodec]) -> bool:
    """Whether a stored entry can serve a shorter prefix: every layer must be trimmable."""
    codecs = list(codecs)
    return all(codec_for_provider(la.provider, codecs).header_trimmable(la.meta) for la in layers)


def entry_minimum_reusable_offset(layers: Sequence[LayerHeader | LayerState],
                                  codecs: Iterable[CacheCodec]) -> int:
    """The shortest prefix a stored entry can serve: the largest of its layers' minimums."""
    codecs = list(codecs)
    return max((codec_for_provider(la.provider, codecs).minimum_reusable_offset(la.meta)
                for la in layers), default=0)


def load_codecs(registry: Registry) -> list[CacheCodec]:
    """One instance of every codec the loaded plugins registered (core's own included)."""
    return [registry.get(Kind.CODEC, name).load()() for name in registry.names(Kind.CODEC)]
