"""The RAM prefix cache: a byte-capped LRU of whole prefix entries, and the reuse rules
every tier applies (DESIGN.md §4.4-4.6, 4.10).

An entry is the per-layer caches after a token sequence, held as *donor* clones: lookups
hand out fresh zero-copy clones trimmed to the match, so a donor is never mutated and one
system prompt's prefill serves any number of requests.

The rules live once, in :func:`usable_length` and :func:`can_serve`, and the SSD index
(:mod:`foretell.cache.ssd`) uses the same two functions on stored headers.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx

from foretell.cache.attachment import attachment_identity
from foretell.cache.codecs import (
    CacheCodec,
    clone_caches,
    entry_minimum_reusable_offset,
    entry_trimmable,
    snapshot_entry,
)
from foretell.model.kvcache import trim_all
from foretell.store.entry import Entry


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share.

    Slice comparisons run in C: the usual case (a stored prefix of the prompt) is one
    comparison, any other a binary search, instead of a Python loop over every token of
    every indexed entry.
    """
    a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    if (a if len(a) == n else a[:n]) == (b if len(b) == n else b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def usable_length(prompt: Sequence[int], tokens: Sequence[int], *, trimmable: bool,
                  min_offset: int) -> int:
    """How many leading prompt tokens an entry holding ``tokens`` can serve (0: none).

    At least one prompt token must still be fed to get logits, so the match is capped at
    ``len(prompt) - 1``. Serving fewer tokens than the entry holds means trimming it, which
    only a trimmable entry can, and never below its minimum reusable offset (invariant 4).
    """
    matched = min(common_prefix(prompt, tokens), len(prompt) - 1)
    if matched <= 0:
        return 0
    if matched == len(tokens):
        return matched
    if not trimmable or matched < min_offset:
        return 0
    return matched


def can_serve(new_tokens: Sequence[int], *, trimmable: bool, min_offset: int,
              old_tokens: Sequence[int], old_attached: bool = False) -> bool:
    """Whether an entry of ``new_tokens`` can serve every prompt an entry of ``old_tokens``
    serves, so storing the new one may drop the old (invariant 6).

    An untrimmable longer entry (a wrapped ring) serves only its exact length; letting it
    displace the prompt snapshot was mlx-bun's "restart-0" defect: the next turn, whose
    reply tokens re-encode differently, then found nothing usable. Likewise an entry with a
    drafter's attachment (``old_attached``) is served exactly by nothing longer: a trimmed
    longer entry would lose the drafter's state, so only the same tokens replace it.
    """
    n = len(old_tokens)
    if n > len(new_tokens) or tuple(new_tokens[:n]) != tuple(old_tokens):
        return False
    if n == len(new_tokens):
        return True
    return trimmable and n >= min_offset and not old_attached


def match_rank(n: int, tokens: Sequence[int], attachment: str | None = None,
               prefer: str | None = None) -> tuple[bool, int, bool]:
    """How well serving ``n`` prompt tokens from an entry of ``tokens`` serves a request
    (compare ranks; higher is better): more tokens, and among as many an entry that keeps
    its drafter's attachment (served untrimmed). ``prefer``: a drafter identity that cannot
    speculate without its own state (it reads hidden states over the prompt); an exact
    boundary carrying that state then beats any longer prefix served trimmed. Without
    attachments the rank is the length alone."""
    kept = n == len(tokens) and attachment is not None
    return (prefer is not None and kept and attachment == prefer, n, kept)


@attrs.define(eq=False)
class PrefixEntry:
    """One sequence's state in RAM: donor caches, never handed out themselves."""

    tokens: tuple[int, ...]
    namespace: str
    caches: list[Any]
    nbytes: int
    trimmable: bool
    min_offset: int
    #: The identity of the drafter state the entry carries (None: none). An attached entry
    #: serves its drafter exactly and is superseded only by an entry of its tokens.
    attachment: str | None = None

    @property
    def attached(self) -> bool:
        return self.attachment is not None

    def usable(self, prompt: Sequence[int]) -> int:
        return usable_length(prompt, self.tokens, trimmable=self.trimmable,
                             min_offset=self.min_offset)

    def serves(self, other: PrefixEntry) -> bool:
        return other.namespace == self.namespace and can_serve(
            self.tokens, trimmable=self.trimmable, min_offset=self.min_offset,
            old_tokens=other.tokens, old_attached=other.attached)


def entry_facts(entry: Entry, codecs: Sequence[CacheCodec]) -> tuple[bool, int]:
    """``(trimmable, minimum reusable offset)`` of a snapshot, through its codecs."""
    return entry_trimmable(entry.layers, codecs), entry_minimum_reusable_offset(entry.layers, codecs)


class PrefixCache:
    """Byte-capped LRU of prefix entries (bytes decide, never entry counts: invariant 10).

    Thread-safe: the request thread looks up and stores while a spill worker may be reading
    an entry's (immutable) arrays.
    """

    def __init__(self, codecs: Sequence[CacheCodec], max_bytes: int):
        self.codecs = list(codecs)
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def entries(self) -> list[PrefixEntry]:
        """Entries, least recently used first."""
        with self._lock:
            return list(self._entries.values())

    def best(self, prompt: Sequence[int], namespace: str, prefer: str | None = None
             ) -> tuple[PrefixEntry | None, int]:
        """The entry serving ``prompt`` best (:func:`match_rank`) and how many tokens it
        serves (no clone made)."""
        best, length, rank = None, 0, match_rank(0, ())
        prompt = tuple(prompt)
        with self._lock:
            for entry in self._entries.values():
                if entry.namespace != namespace:
                    continue
                n = entry.usable(prompt)
                candidate = match_rank(n, entry.tokens, entry.attachment, prefer)
                if n > 0 and candidate > rank:
                    best, length, rank = entry, n, candidate
        return best, length

    def exact(self, tokens: Sequence[int], namespace: str) -> bool:
        """Whether an entry holds exactly ``tokens`` (marks it recently used)."""
        tokens = tuple(tokens)
        with self._lock:
            for key, entry in self._entries.items():
                if entry.namespace == namespace and entry.tokens == tokens:
                    self._entries.move_to_end(key)
                    return True
        return False

    def take(self, entry: PrefixEntry, length: int) -> list[Any]:
        """Fresh clones of ``entry``'s caches trimmed to ``length`` tokens; marks it used."""
        with self._lock:
            if id(entry) in self._entries:
                self._entries.move_to_end(id(entry))
        caches = clone_caches(entry.caches, self.codecs)
        trim_all(caches, len(entry.tokens) - length)
        return caches

    def lookup(self, prompt: Sequence[int], namespace: str = "") -> tuple[list[Any] | None, int]:
        """Clones holding the longest usable prefix of ``prompt``, and its length."""
        entry, length = self.best(prompt, namespace)
        if entry is None:
            self.misses += 1
            return None, 0
        self.hits += 1
        return self.take(entry, length), length

    def put(self, tokens: Sequence[int], caches: Sequence[Any], namespace: str = "") -> bool:
        """Keep the state of ``caches`` after ``tokens`` (zero-copy; the caller may go on
        using its caches). False if the entry alone exceeds the cap."""
        donors = clone_caches(caches, self.codecs)
        # The clones are views of the caches' buffers, which keep their unused slots alive
        # too (up to 255 tokens per layer; up to 1,023 after fixed-shape forwards on CUDA,
        # foretell.model.fixed): the cap counts what is held, not only what is viewed.
        held = sum(getattr(c, "nbytes", 0) for c in caches)
        return self.adopt(tokens, donors, namespace, held_bytes=held) is not None

    def adopt(self, tokens: Sequence[int], donors: list[Any], namespace: str = "", *,
              held_bytes: int = 0) -> PrefixEntry | None:
        """Keep ``donors`` (caches nobody else holds) as the entry for ``tokens``;
        ``held_bytes``: the memory they keep alive, when more than their tensors' bytes."""
        tokens = tuple(tokens)
        if any(c.offset != len(tokens) for c in donors):
            raise ValueError(f"caches hold {[c.offset for c in donors][:3]}... tokens, "
                             f"not the {len(tokens)} of the entry")
        snapshot = snapshot_entry(tokens, donors, self.codecs, namespace)
        # Evaluated now, on the thread that computed them: MLX streams are per thread, and
        # a request on another thread evaluating a clone of a still-lazy view failed ("no
        # Stream(cpu, 1) in current thread"). The views share the caches' buffers: no copy.
        mx.eval([t for layer in snapshot.layers for t in layer.tensors.values()])
        trimmable, min_offset = entry_facts(snapshot, self.codecs)
        entry = PrefixEntry(tokens=tokens, namespace=namespace, caches=donors,
                            nbytes=max(snapshot.tensor_bytes, held_bytes), trimmable=trimmable,
                            min_offset=min_offset,
                            attachment=attachment_identity(snapshot.layers))
        if entry.nbytes > self.max_bytes:
            return None
        with self._lock:
            for key, old in list(self._entries.items()):
                if entry.serves(old):
                    del self._entries[key]
            self._entries[id(entry)] = entry
            total = sum(e.nbytes for e in self._entries.values())
            while total > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                total -= evicted.nbytes
                self.evictions += 1
        return entry

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
