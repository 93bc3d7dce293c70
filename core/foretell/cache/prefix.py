"""The RAM prefix cache: a byte-capped LRU of whole prefix entries, and the reuse rules
every tier applies (DESIGN.md §4.4-4.6, 4.10).

An entry is the per-layer caches after a token sequence, held as *donor* clones: lookups
hand out fresh zero-copy clones trimmed to the match, so a donor is never mutated and one
system prompt's prefill serves any number of requests.

The rules live once, in :func:`usable_length` and :func:`can_serve`, and the SSD index
(:mod:`foretell.cache.ssd`) uses the same two functions on stored headers.

Each namespace's entries are also kept sorted by tokens (:class:`SortedEntries`, which the
SSD index keeps too): the entries sharing the most leading tokens with a prompt are its
neighbours in that order, so a lookup costs the prompt's length and the entries sharing a
prefix with it, not the cache's size.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from bisect import bisect_left, bisect_right
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import attrgetter
from typing import Any, Generic, Protocol, TypeVar

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

#: A tie of at least this many entries is looked for in the LRU order first
#: (:meth:`SortedEntries.best`), through at most an eighth as many entries as it holds.
LRU_PROBE_FROM = 64


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
    return usable_match(min(common_prefix(prompt, tokens), len(prompt) - 1), len(tokens),
                        trimmable=trimmable, min_offset=min_offset)


def usable_match(matched: int, held: int, *, trimmable: bool, min_offset: int) -> int:
    """:func:`usable_length` once the shared tokens are known: ``matched`` leading prompt
    tokens (already capped at ``len(prompt) - 1``) shared with an entry of ``held`` tokens."""
    if matched <= 0:
        return 0
    if matched == held:
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
    #: When the cache last used it (a clock, higher is more recent): among equal matches
    #: the least recently used entry serves, as the LRU order would pick it.
    used: int = attrs.field(default=0, init=False)

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


class Indexed(Protocol):
    """What :class:`SortedEntries` keeps: a RAM entry (:class:`PrefixEntry`) or a stored
    one's index record (:class:`foretell.cache.ssd.Stored`)."""

    @property
    def tokens(self) -> tuple[int, ...]: ...

    @property
    def namespace(self) -> str: ...

    @property
    def trimmable(self) -> bool: ...

    @property
    def min_offset(self) -> int: ...

    @property
    def attachment(self) -> str | None: ...


E = TypeVar("E", bound=Indexed)


class SortedEntries(Generic[E]):
    """One namespace's entries in token order.

    In that order the leading tokens an entry shares with a prompt never grow walking away
    from the prompt's place: the entries sharing the most are its neighbours, and a lookup
    walks outwards only until a match is found. Entries of equal tokens (a stored index may
    list one state under two keys; the RAM cache never holds two) sit side by side, and
    every choice among equals goes by the caller's ``age``.
    """

    def __init__(self, entries: Iterable[E] = ()) -> None:
        self.entries: list[E] = sorted(entries, key=attrgetter("tokens"))
        self.keys: list[tuple[int, ...]] = [entry.tokens for entry in self.entries]
        self.attachments: Counter[str] = Counter(
            entry.attachment for entry in self.entries if entry.attachment is not None)

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, entry: E) -> None:
        at = bisect_right(self.keys, entry.tokens)
        self.keys.insert(at, entry.tokens)
        self.entries.insert(at, entry)
        if entry.attachment is not None:
            self.attachments[entry.attachment] += 1

    def remove(self, entry: E) -> None:
        """Drop ``entry`` itself (not an equal one): it must be held."""
        at = bisect_left(self.keys, entry.tokens)
        while self.entries[at] is not entry:
            at += 1
        del self.keys[at], self.entries[at]
        if entry.attachment is not None:
            self.attachments[entry.attachment] -= 1

    def find(self, tokens: tuple[int, ...]) -> E | None:
        at = bisect_left(self.keys, tokens)
        return self.entries[at] if at < len(self.keys) and self.keys[at] == tokens else None

    def runs(self, tokens: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
        """``(shared, start, stop)``: the entries ``entries[start:stop]`` share exactly
        ``shared`` (at least 1) leading tokens with ``tokens``; most shared first. A run
        before ``tokens``' place starts with the entries holding ``tokens[:shared]``, if any."""
        at = bisect_left(self.keys, tokens)
        return heapq.merge(self._runs_before(tokens, at - 1), self._runs_after(tokens, at),
                           key=lambda run: -run[0])

    def prefixes(self, tokens: tuple[int, ...]) -> list[E]:
        """The entries whose tokens begin ``tokens``, ``tokens`` itself included."""
        at = bisect_left(self.keys, tokens)
        found = self._twins(at) if at < len(self.keys) and self.keys[at] == tokens else []
        for shared, start, _ in self._runs_before(tokens, at - 1):
            if len(self.keys[start]) == shared:
                found += self._twins(start)
        if tokens and self.keys and not self.keys[0]:  # no tokens: shares none, begins all
            found += self._twins(0)
        return found

    def extensions(self, tokens: tuple[int, ...]) -> Iterator[E]:
        """The entries whose tokens ``tokens`` begins, ``tokens`` itself first."""
        start = bisect_left(self.keys, tokens)
        return (self.entries[at] for at in range(start, self._past(tokens, start)))

    def best(self, prompt: tuple[int, ...], prefer: str | None, *, age: Callable[[E], Any],
             oldest: Iterable[E]) -> tuple[E | None, int]:
        """The entry serving ``prompt`` best (:func:`match_rank`; among equals the one of
        least ``age``) and how many tokens it serves. ``oldest``: the cache's entries, of
        every namespace, in ``age`` order (where a long tie is looked for first)."""
        cap = len(prompt) - 1  # one prompt token is always fed
        if cap < 1:
            return None, 0
        if prefer is not None and self.attachments[prefer] > 0:
            # An exact boundary carrying ``prefer``'s state outranks any other match
            # (match_rank), the longest such first.
            kept = [e for e in self.prefixes(prompt[:cap]) if e.attachment == prefer and e.tokens]
            if kept:
                longest = max(len(e.tokens) for e in kept)
                return min((e for e in kept if len(e.tokens) == longest), key=age), longest
        for n, group in itertools.groupby(self.runs(prompt), key=lambda r: min(r[0], cap)):
            runs = list(group)
            # Entries of the prompt's first n tokens start their run; one carrying a
            # drafter's state is served whole: it outranks a trim.
            kept = [e for _, start, _ in runs if len(self.keys[start]) == n
                    for e in self._twins(start) if e.attachment is not None]
            if kept:
                return min(kept, key=age), n
            # Every other usable match of n tokens ranks alike.
            entry = self._least_recent(runs, prompt, n, age, oldest)
            if entry is not None:
                return entry, n
        return None, 0

    def _least_recent(self, runs: list[tuple[int, int, int]], prompt: tuple[int, ...], n: int,
                      age: Callable[[E], Any], oldest: Iterable[E]) -> E | None:
        """The entry of least ``age`` among ``runs``' that serve ``n`` prompt tokens."""
        size = sum(stop - start for _, start, stop in runs)
        if size >= LRU_PROBE_FROM:
            # Entries opening with one system prompt all tie for a new conversation: the
            # oldest entries are then the likeliest, and the cheapest to find.
            namespace = self.entries[runs[0][1]].namespace
            for entry in itertools.islice(oldest, size // 8 + 1):
                if entry.namespace == namespace and usable_length(
                        prompt, entry.tokens, trimmable=entry.trimmable,
                        min_offset=entry.min_offset) == n:
                    return entry
        usable = (entry for _, start, stop in runs for entry in self.entries[start:stop]
                  if usable_match(n, len(entry.tokens), trimmable=entry.trimmable,
                                  min_offset=entry.min_offset))
        return min(usable, key=age, default=None)

    def _twins(self, at: int) -> list[E]:
        """The entries from ``at`` on that hold ``keys[at]``."""
        return self.entries[at:bisect_right(self.keys, self.keys[at], at)]

    def _past(self, tokens: tuple[int, ...], lo: int) -> int:
        """The first place past every entry whose tokens begin ``tokens`` (from ``lo``)."""
        if not tokens:
            return len(self.keys)
        return bisect_left(self.keys, (*tokens[:-1], tokens[-1] + 1), lo)

    def _runs_before(self, tokens: tuple[int, ...], last: int) -> Iterator[tuple[int, int, int]]:
        while last >= 0:
            shared = common_prefix(tokens, self.keys[last])
            if shared == 0:
                return
            first = bisect_left(self.keys, tokens[:shared], 0, last)
            yield shared, first, last + 1
            last = first - 1

    def _runs_after(self, tokens: tuple[int, ...], first: int) -> Iterator[tuple[int, int, int]]:
        while first < len(self.keys):
            shared = common_prefix(tokens, self.keys[first])
            if shared == 0:
                return
            stop = self._past(tokens[:shared], first + 1)
            yield shared, first, stop
            first = stop


class PrefixCache:
    """Byte-capped LRU of prefix entries (bytes decide, never entry counts: invariant 10).

    Thread-safe: the request thread looks up and stores while a spill worker may be reading
    an entry's (immutable) arrays.
    """

    def __init__(self, codecs: Sequence[CacheCodec], max_bytes: int):
        self.codecs = list(codecs)
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # oldest first
        self._sorted: dict[str, SortedEntries[PrefixEntry]] = {}  # by namespace
        self._bytes = 0
        self._clock = itertools.count(1)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def bytes(self) -> int:
        with self._lock:
            return self._bytes

    def entries(self) -> list[PrefixEntry]:
        """Entries, least recently used first."""
        with self._lock:
            return list(self._entries.values())

    def best(self, prompt: Sequence[int], namespace: str, prefer: str | None = None
             ) -> tuple[PrefixEntry | None, int]:
        """The entry serving ``prompt`` best (:func:`match_rank`; among equals the least
        recently used) and how many tokens it serves (no clone made)."""
        with self._lock:
            index = self._sorted.get(namespace)
            if index is None:
                return None, 0
            return index.best(tuple(prompt), prefer, age=attrgetter("used"),
                              oldest=self._entries.values())

    def exact(self, tokens: Sequence[int], namespace: str) -> bool:
        """Whether an entry holds exactly ``tokens`` (marks it recently used)."""
        tokens = tuple(tokens)
        with self._lock:
            index = self._sorted.get(namespace)
            entry = index.find(tokens) if index is not None else None
            if entry is None:
                return False
            self._touch(entry)
        return True

    def take(self, entry: PrefixEntry, length: int) -> list[Any]:
        """Fresh clones of ``entry``'s caches trimmed to ``length`` tokens; marks it used."""
        with self._lock:
            if id(entry) in self._entries:
                self._touch(entry)
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
        return entry if self.hold(entry) else None

    def hold(self, entry: PrefixEntry) -> bool:
        """Keep a built entry as the most recently used: it drops the entries it serves
        (:meth:`PrefixEntry.serves`), then the least recently used go past the cap. False
        (nothing changed) if the entry alone exceeds the cap."""
        if entry.nbytes > self.max_bytes:
            return False
        with self._lock:
            index = self._sorted.get(entry.namespace)
            for old in index.prefixes(entry.tokens) if index is not None else ():
                if entry.serves(old):  # only an entry's prefixes can be served by it
                    self._drop(old)
            self._sorted.setdefault(entry.namespace, SortedEntries()).add(entry)
            self._entries[id(entry)] = entry
            entry.used = next(self._clock)
            self._bytes += entry.nbytes
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries.values())))
                self.evictions += 1
        return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._sorted.clear()
            self._bytes = 0

    def _touch(self, entry: PrefixEntry) -> None:
        self._entries.move_to_end(id(entry))
        entry.used = next(self._clock)

    def _drop(self, entry: PrefixEntry) -> None:
        del self._entries[id(entry)]
        index = self._sorted[entry.namespace]
        index.remove(entry)
        if not index:
            del self._sorted[entry.namespace]
        self._bytes -= entry.nbytes
