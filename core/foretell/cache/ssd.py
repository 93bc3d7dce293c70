"""The persistent tier's index and policy over any storage layout (a directory's, or one
over a service such as Redis: nothing here knows where the bytes are).

The layout stores and verifies bytes (:class:`foretell.store.layout.StorageLayout`); this
index decides: which stored entry serves a prompt (the same :func:`usable_length` as RAM,
looked up the same way: :class:`~foretell.cache.prefix.SortedEntries`), which entries a new
one supersedes (:func:`can_serve`, so the restart-0 defect cannot return), and what is
evicted to keep stored bytes under the cap (least recently used, bytes not counts:
invariant 10).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence

import attrs

from foretell.cache.attachment import attachment_identity
from foretell.cache.codecs import (
    CacheCodec,
    CodecError,
    entry_minimum_reusable_offset,
    entry_trimmable,
)
from foretell.cache.prefix import SortedEntries, can_serve
from foretell.store.entry import Entry, EntryHeader, LayerForm, form_mismatch
from foretell.store.layout import FindsPrefixes, LimitsCapacity, ScanJournal, StorageLayout

log = logging.getLogger("foretell.cache")


@attrs.frozen
class Stored:
    """An indexed entry: its header plus the reuse facts its codecs give."""

    header: EntryHeader
    trimmable: bool
    min_offset: int
    #: The identity of the drafter state it carries (see :func:`foretell.cache.prefix.can_serve`).
    attachment: str | None = None

    @property
    def attached(self) -> bool:
        return self.attachment is not None

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.header.tokens

    @property
    def namespace(self) -> str:
        return self.header.namespace


#: How old this process's view of the store may be when a write evicts, at least: other
#: processes sharing the store write entries it has not indexed, and the cap holds over
#: them too (0: a write re-reads whenever re-reading stays within :data:`RESCAN_SHARE`).
RESCAN_S = 0.0
#: Re-reads take at most this share of the time: a write re-reads the directory only when
#: the view is older than the last re-read's duration divided by it. A re-read stats each
#: file and reads only new or changed ones, so a small directory is re-read at every write
#: and one of tens of thousands of entries every few seconds.
RESCAN_SHARE = 0.05


class SsdIndex:
    """Lookup, supersession and the byte cap for one layout; safe across threads."""

    def __init__(self, layout: StorageLayout, codecs: Sequence[CacheCodec], max_bytes: int,
                 rescan_s: float = RESCAN_S, structure: Sequence[LayerForm] | None = None):
        self.layout = layout
        #: Asked once: a protocol check costs microseconds, and each lookup would ask it.
        self._finds_prefixes = isinstance(layout, FindsPrefixes)
        self.codecs = list(codecs)
        self.max_bytes = max_bytes
        #: The form of the model's cache layers (``foretell.cache.tier.engine_structure``):
        #: a read entry whose layers differ is deleted, never served. None: unchecked.
        self.structure = tuple(structure) if structure is not None else None
        self.rescan_s = rescan_s
        self._scanned_at = float("-inf")
        self._rescan_cost = 0.0
        self._warned: set[str] = set()
        self._lock = threading.RLock()
        self._index: dict[str, Stored] = {}
        #: Each namespace's entries in token order, in step with ``_index``: a lookup looks
        #: at the prompt's neighbours, not at every entry. A layout's keys need not be its
        #: ``key_for``'s (a plugin's, or what ``prefixes`` returns), so one namespace may
        #: hold equal tokens under two keys: both are kept, and ties go as below.
        self._sorted: dict[str, SortedEntries[Stored]] = {}
        #: Each key's place in ``_index``'s order: among equal ranks the entry first in
        #: that order serves (the order of the last re-read, least recently used first,
        #: then each key as it was indexed).
        self._order: dict[str, int] = {}
        self._placed = itertools.count()
        self._journal = ScanJournal()
        self.restores = 0
        self.restore_failures = 0
        self.writes = 0
        self.evictions = 0

    # -- the index --------------------------------------------------------------------------

    def scan(self) -> list[Stored]:
        """Rebuild the index from the layout (reaps orphans, drops corrupt entries), evict
        down to the cap, then collect what no entry uses any more (so what another process
        left over this cap is freed as the tier opens, not at its first write)."""
        self._reindex()
        self._evict_to_cap(keep=())
        self.layout.collect()
        with self._lock:
            return list(self._index.values())

    def _reindex(self) -> None:
        """The index rebuilt from the layout's scan (what any process stored there), each
        entry keeping the later of its last use on disk and in this process (a RAM hit
        marks only the latter), and what another thread changed meanwhile kept
        (:class:`~foretell.store.layout.ScanJournal`)."""
        started = time.monotonic()
        with self._lock:
            changes = self._journal.begin()
        try:
            headers = self.layout.scan()
        except BaseException:
            with self._lock:
                self._journal.finish(changes, {})
            raise
        found = {h.key: s for h in headers if (s := self._stored(h)) is not None}
        with self._lock:
            self._journal.finish(changes, found)
            for key, stored in found.items():
                seen = self._index.get(key)
                if seen is not None and seen.header.last_used > stored.header.last_used:
                    found[key] = attrs.evolve(stored, header=attrs.evolve(
                        stored.header, last_used=seen.header.last_used))
            self._replace(found)
            self._scanned_at = time.monotonic()
            self._rescan_cost = self._scanned_at - started

    def _stored(self, header: EntryHeader) -> Stored | None:
        try:
            return Stored(header, entry_trimmable(header.layers, self.codecs),
                          entry_minimum_reusable_offset(header.layers, self.codecs),
                          attachment_identity(header.layers))
        except CodecError:  # the layout checked providers; a codec may still refuse meta
            return None

    def _replace(self, index: dict[str, Stored]) -> None:
        """Index exactly ``index``, in its order (under the lock)."""
        self._index = index
        self._order = {key: next(self._placed) for key in index}
        by_namespace: defaultdict[str, list[Stored]] = defaultdict(list)
        for stored in index.values():
            by_namespace[stored.namespace].append(stored)
        self._sorted = {namespace: SortedEntries(entries)
                        for namespace, entries in by_namespace.items()}

    def _put(self, stored: Stored, *, update: bool = False) -> None:
        """Index ``stored`` (under the lock); ``update``: a newer last use of an entry that
        a re-read running meanwhile must not bring back if it found the entry gone."""
        key = stored.header.key
        old = self._index.get(key)
        if old is not None:
            self._unsort(old)
        else:
            self._order[key] = next(self._placed)
        self._index[key] = stored  # a known key keeps its place in the order
        self._sorted.setdefault(stored.namespace, SortedEntries()).add(stored)
        self._journal.record(key, stored, if_present=update)

    def _drop(self, key: str) -> None:
        """Unindex ``key`` (under the lock)."""
        old = self._index.pop(key, None)
        if old is not None:
            self._unsort(old)
            del self._order[key]
        self._journal.record(key, None)

    def _unsort(self, stored: Stored) -> None:
        index = self._sorted[stored.namespace]
        index.remove(stored)
        if not index:
            del self._sorted[stored.namespace]

    def entries(self) -> list[Stored]:
        with self._lock:
            return sorted(self._index.values(), key=lambda s: s.header.last_used)

    def bytes(self) -> int:
        """Bytes the layout counts for what it serves (shared blocks once: invariant 10)."""
        return self.layout.bytes()

    # -- lookup -----------------------------------------------------------------------------

    def find(self, prompt: Sequence[int], namespace: str, prefer: str | None = None, *,
             beyond: int = 0) -> tuple[Stored | None, int]:
        """The stored entry serving ``prompt`` best (:func:`match_rank`; no bytes read) and
        how many tokens it serves; among equals the first in the index's order. From the
        index (the prompt's neighbours in token order); a layout that finds prefixes itself
        (:class:`~foretell.store.layout.FindsPrefixes`: one shared by other processes) is
        asked too when the best it could add serves more than ``beyond`` tokens (what RAM
        serves) and the index's, and what it returns joins the index."""
        prompt = tuple(prompt)
        best, length = self._best(prompt, namespace, prefer)
        if (self._finds_prefixes
                and max(beyond, length) < len(prompt) - 1 and self._learn(
                    prompt, namespace, max(beyond, length))):
            best, length = self._best(prompt, namespace, prefer)
        return best, length

    def _learn(self, prompt: tuple[int, ...], namespace: str, beyond: int) -> bool:
        """Index the entries the layout says may serve more than ``beyond`` tokens of
        ``prompt``; True if any is new or changed. A layout that raises (a plugin's defect)
        is said once, and the index answers alone (invariant 9)."""
        try:
            headers = self.layout.prefixes(prompt, namespace, beyond)
        except Exception as exc:  # noqa: BLE001 - any plugin's failure, reported once
            self.warn_once("layout prefixes", f"storage layout {type(self.layout).__name__} "
                           f"failed to find stored prefixes ({type(exc).__name__}: {exc}); "
                           "using what its last scan found")
            return False
        learned = False
        with self._lock:
            for header in headers:
                known = self._index.get(header.key)
                if known is not None and known.header.tokens == header.tokens:
                    continue
                stored = self._stored(header)
                if stored is not None:
                    self._put(stored)
                    learned = True
        return learned

    def _best(self, prompt: tuple[int, ...], namespace: str, prefer: str | None
              ) -> tuple[Stored | None, int]:
        with self._lock:
            index = self._sorted.get(namespace)
            if index is None:
                return None, 0
            return index.best(prompt, prefer, age=self._place, oldest=self._index.values())

    def _place(self, stored: Stored) -> int:
        return self._order[stored.header.key]

    def in_namespace(self, namespace: str) -> list[Stored]:
        """Every entry of one namespace (a generation's checkpoints), oldest first (as
        :meth:`entries` orders them)."""
        with self._lock:
            index = self._sorted.get(namespace)
            return sorted(index.entries if index is not None else (),
                          key=lambda s: (s.header.last_used, self._place(s)))

    def find_exact(self, tokens: Sequence[int], namespace: str) -> Stored | None:
        """The entry holding exactly ``tokens`` (a known session's checkpoint)."""
        key = self.layout.key_for(tokens, namespace)
        with self._lock:
            stored = self._index.get(key)
        return stored if stored is not None and stored.tokens == tuple(tokens) else None

    def touch(self, tokens: Sequence[int], namespace: str) -> None:
        """A RAM hit used this state: its stored copy is recently used too (in this process's
        eviction order; on disk, last use is the file's last read or write)."""
        stored = self.find_exact(tokens, namespace)
        if stored is not None:
            with self._lock:
                if stored.header.key in self._index:
                    self._put(attrs.evolve(
                        stored, header=attrs.evolve(stored.header, last_used=time.time())),
                        update=True)

    def covers(self, tokens: Sequence[int], namespace: str, *, attached: bool = False) -> bool:
        """Whether some stored entry can restore exactly ``tokens`` (with a drafter's
        attachment, when the state had one)."""
        with self._lock:
            index = self._sorted.get(namespace)
            return index is not None and any(  # only an entry beginning with them can
                can_serve(s.tokens, trimmable=s.trimmable, min_offset=s.min_offset,
                          old_tokens=tokens, old_attached=attached)
                for s in index.extensions(tuple(tokens)))

    def read(self, stored: Stored) -> Entry | None:
        """The entry's bytes, verified by the layout; a failed read drops it from the index.
        A layout that raises instead of returning None (a plugin's defect) fails the read
        the same way, with one warning: the cold tier never takes serving down (invariant 9).
        An entry whose layers are not what the model's caches hold (:attr:`structure`) is
        deleted as a damaged one is, with one warning: every byte may pass its checksum
        and still be, say, float32 keys labelled int32.
        """
        key = stored.header.key
        try:
            entry = self.layout.read(key)
        except Exception as exc:  # noqa: BLE001 - any plugin's failure, reported below
            self.warn_once("layout read", f"storage layout {type(self.layout).__name__} "
                           f"failed to read an entry ({type(exc).__name__}: {exc}); serving "
                           "it from the prompt instead")
            entry = None
        why = (form_mismatch(entry.layers, self.structure)
               if entry is not None and self.structure is not None else None)
        if why is not None:
            self.warn_once("structure", f"cache entry {key} is not what this model's caches "
                           f"hold ({why}); deleted, not served")
            self.layout.remove(key)
            entry = None
        with self._lock:
            if entry is None:
                self.restore_failures += 1
                self._drop(key)
            else:
                self.restores += 1
                if key in self._index:  # unless evicted meanwhile: it is gone from disk
                    self._put(attrs.evolve(
                        stored, header=attrs.evolve(stored.header, last_used=time.time())),
                        update=True)
        return entry

    def warn_once(self, kind: str, message: str) -> None:
        """A warning the first time for each ``kind``, debug logging after (a defect or a
        setting repeats at every use)."""
        log.log(logging.DEBUG if kind in self._warned else logging.WARNING, message)
        self._warned.add(kind)

    def cap(self) -> int:
        """The byte cap in force: ``max_bytes``, or less where the layout's store has a
        limit of its own (:class:`~foretell.store.layout.LimitsCapacity`), so this index
        evicts before the store would (a Redis server's ``maxmemory``)."""
        if isinstance(self.layout, LimitsCapacity):
            limit = self.layout.capacity()
            if limit is not None:
                return min(self.max_bytes, limit)
        return self.max_bytes

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` can be stored under the cap at all; one that
        cannot is the cap's doing, not a failed write: said once, kept in RAM only."""
        cap = self.cap()
        if nbytes <= cap:
            return True
        self.warn_once("over cap", f"a cache entry of {nbytes / 2**20:.1f} MiB is larger than "
                       f"the cache's cap ({cap / 2**20:.1f} MiB): kept in RAM only "
                       "(raise --cache-max-gb, or the store's own limit, to store such "
                       "prompts)")
        return False

    # -- writes -----------------------------------------------------------------------------

    def write(self, entry: Entry) -> bool:
        """Store ``entry``; supersede what it can serve; evict to the cap. True if durable.
        A write the layout does not report durable (its file may be there, its name not
        yet on disk) is not indexed and supersedes nothing: its ancestors stay until a
        durable write can serve them, and ``covers`` does not count it (a later re-read of
        the directory indexes it if it is there)."""
        if not self.fits(entry.tensor_bytes) or not self.layout.write(entry):
            return False
        if time.monotonic() - self._scanned_at >= max(self.rescan_s,
                                                      self._rescan_cost / RESCAN_SHARE):
            self._reindex()  # what other processes wrote since counts against the cap too
        key = self.layout.key_for(entry.tokens, entry.namespace)
        header = next((h for h in self.layout.headers() if h.key == key), None)
        if header is None:
            return False
        with self._lock:
            self.writes += 1
            new = self._stored(header)
            if new is None:
                return True
            self._put(new)
            removed = self.evictions
            index = self._sorted.get(entry.namespace)
            # Only an entry's prefixes can be served by it.
            for old in index.prefixes(new.tokens) if index is not None else ():
                if old.header.key != key and can_serve(
                        new.tokens, trimmable=new.trimmable, min_offset=new.min_offset,
                        old_tokens=old.tokens, old_attached=old.attached):
                    self._remove(old.header.key)
                    removed -= 1
        self._evict_to_cap(keep=(key,))
        if removed != self.evictions:  # free what only the removed entries used (blocks)
            self.layout.collect()
        return True

    def remove(self, key: str) -> None:
        with self._lock:
            self._remove(key)

    def forget(self, key: str) -> None:
        """Stop serving an entry in this process, leaving it stored (until a re-read)."""
        with self._lock:
            self._drop(key)

    def _remove(self, key: str) -> None:
        self._drop(key)
        self.layout.remove(key)

    def _evict_to_cap(self, keep: Sequence[str]) -> None:
        with self._lock:
            # The layout's figure, re-read after each removal: an entry sharing blocks with
            # others frees only what no other entry uses.
            total, cap = self.layout.bytes(), self.cap()
            if total <= cap:  # the usual write: no need to order every entry
                return
            for stored in sorted(self._index.values(), key=lambda s: s.header.last_used):
                if total <= cap:
                    break
                if stored.header.key in keep:
                    continue
                self._remove(stored.header.key)
                total = self.layout.bytes()
                self.evictions += 1

