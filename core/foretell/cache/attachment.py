"""Draft-side state stored with a cache entry: the attachment layer.

A :class:`~foretell.spec.contract.DraftState` is stored as one more layer of the target's
entry (before a checkpoint's mark), so there is one entry and one set of rules: a
:class:`DraftAttachment`, the state as tensors + JSON meta (the drafter's KV caches through
the tier's codecs), labelled with the draft artifact's identity and never restored for
another. It holds at one exact boundary: serving a shorter prefix marks it ``stale``, and
an attached entry is superseded only by one of exactly its tokens (``prefix.can_serve``).

Relative to the entry's tokens ``T``, the drafter knew ``T + ahead`` (``ahead``: the
target's pending token), of which it had taken in the first ``seen``; the rest is the
``feed`` it has not heard yet, with the target's hidden states (``feed.hidden``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import mlx.core as mx

from foretell.cache.codecs import CacheCodec, codec_for, codec_for_provider
from foretell.errors import CodecError

#: The provider id of the attachment layer; entries holding one serve exact boundaries.
ATTACHMENT_PROVIDER = "foretell.baseline/draft-state@1"


@attrs.define(eq=False)
class DraftAttachment:
    """A drafter's state at the boundary of ``offset`` target tokens (a cache layer)."""

    identity: str
    offset: int
    tensors: dict[str, mx.array]
    meta: dict[str, Any]
    #: Set when the entry was served trimmed to a shorter prefix: never restore it then.
    stale: bool = False

    # The cache interface the tier applies to every layer of an entry.
    def is_trimmable(self) -> bool:
        return True

    def stays_trimmable(self, n: int) -> bool:
        return True

    def trim(self, n: int) -> int:
        if n > 0:
            self.stale = True
            self.offset -= n
        return n

    @property
    def state(self) -> tuple[mx.array, ...]:
        return tuple(self.tensors.values())

    @property
    def ahead(self) -> list[int]:
        return list(self.meta["ahead"])

    @property
    def seen(self) -> int:
        return int(self.meta["seen"])

    @property
    def keys(self) -> list[int] | None:
        keys = self.meta.get("keys")
        return list(keys) if keys is not None else None


class DraftAttachmentCodec:
    """The attachment layer: tensors as flattened, meta as JSON."""

    name = "draft-state"
    provider_id = ATTACHMENT_PROVIDER

    def matches(self, cache: Any) -> bool:
        return type(cache) is DraftAttachment

    def snapshot(self, cache: DraftAttachment) -> tuple[dict[str, mx.array], dict[str, Any]]:
        return dict(cache.tensors), {"identity": cache.identity, "offset": cache.offset,
                                     **cache.meta}

    def load(self, tensors: Mapping[str, mx.array], meta: Mapping[str, Any]) -> DraftAttachment:
        rest = {k: v for k, v in meta.items() if k not in ("identity", "offset")}
        for field in ("seen", "ahead", "caches", "state"):
            if field not in rest:
                raise CodecError(f"draft-state layer: meta has no '{field}'")
        return DraftAttachment(identity=str(meta["identity"]), offset=int(meta["offset"]),
                               tensors=dict(tensors), meta=rest)

    def clone(self, cache: DraftAttachment) -> DraftAttachment:
        # Arrays are values and meta is never mutated: a new holder is a full copy.
        return attrs.evolve(cache)

    def header_trimmable(self, meta: Mapping[str, Any]) -> bool:
        return True  # the target part serves shorter prefixes; the attachment goes stale

    def minimum_reusable_offset(self, meta: Mapping[str, Any]) -> int:
        return 0


def has_attachment(layers: Sequence[Any]) -> bool:
    """Whether a stored entry (its layer headers or states) carries draft state."""
    return attachment_identity(layers) is not None


def attachment_identity(layers: Sequence[Any]) -> str | None:
    """The draft identity of a stored entry's attachment (from its layer meta), or None."""
    for layer in layers:
        if getattr(layer, "provider", None) == ATTACHMENT_PROVIDER:
            return str(layer.meta.get("identity"))
    return None


def split_attachment(caches: list[Any]) -> tuple[list[Any], DraftAttachment | None]:
    """The target's caches and the entry's attachment (None if absent or stale)."""
    if caches and type(caches[-1]) is DraftAttachment:
        attachment = caches[-1]
        return caches[:-1], None if attachment.stale else attachment
    return caches, None


def attach(state: Any, *, identity: str, offset: int, ahead: Sequence[int], seen: int,
           feed_hidden: mx.array | None, codecs: Sequence[CacheCodec],
           keys: Sequence[int] | None) -> DraftAttachment:
    """Flatten a source's :class:`~foretell.spec.contract.DraftState` into an attachment.

    Its caches go through the tier's codecs (the same snapshot a target layer gets), so the
    drafter's KV is stored and checked like the target's.
    """
    tensors: dict[str, mx.array] = {}
    layers = []
    for i, cache in enumerate(state.caches):
        codec = codec_for(cache, codecs)
        cache_tensors, cache_meta = codec.snapshot(cache)
        layers.append({"codec": codec.name, "provider": codec.provider_id,
                       "meta": dict(cache_meta), "tensors": sorted(cache_tensors)})
        tensors.update({f"cache.{i}.{name}": t for name, t in cache_tensors.items()})
    tensors.update({f"state.{name}": t for name, t in state.tensors.items()})
    if feed_hidden is not None:
        tensors["feed.hidden"] = feed_hidden
    meta = {"seen": seen, "ahead": [int(t) for t in ahead], "caches": layers,
            "state": dict(state.meta), "keys": list(keys) if keys is not None else None}
    return DraftAttachment(identity=identity, offset=offset, tensors=tensors, meta=meta)


def unpack(attachment: DraftAttachment, codecs: Sequence[CacheCodec], *, with_keys: bool) -> Any:
    """The :class:`~foretell.spec.contract.DraftState` an attachment was made from (caches
    rebuilt through the codecs that wrote them; zero-copy). The random stream comes back
    only ``with_keys`` (a resumed generation), so a new request draws its own."""
    from foretell.spec.contract import DraftState

    caches = []
    for i, layer in enumerate(attachment.meta["caches"]):
        codec = codec_for_provider(layer["provider"], codecs)
        tensors = {name: attachment.tensors[f"cache.{i}.{name}"] for name in layer["tensors"]}
        caches.append(codec.load(tensors, layer["meta"]))
    tensors = {name.removeprefix("state."): t for name, t in attachment.tensors.items()
               if name.startswith("state.")}
    return DraftState(caches=caches, tensors=tensors, meta=dict(attachment.meta["state"]),
                      keys=attachment.keys if with_keys else None)


def feed_hidden(attachment: DraftAttachment) -> mx.array | None:
    """The target's hidden states for the feed the source had not heard yet (or None)."""
    return attachment.tensors.get("feed.hidden")
