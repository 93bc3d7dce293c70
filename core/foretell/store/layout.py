"""The storage-layout contract: what ``foretell_register_storage_layouts`` factories build.

A layout only *stores*. It writes an entry atomically, reads it back verified, lists what it
holds from headers, removes one entry, garbage-collects storage no entry uses, and counts
bytes. Policy (lookup, supersession, eviction by byte caps, the spill queue, durability)
belongs to the cache tier in core (:mod:`foretell.cache.tier`), so every layout gets the same
rules (DESIGN.md §3, §4).

Errors a layout raises are :class:`StoreError` (a :class:`~foretell.errors.ForetellError`);
I/O failures while writing are *not* raised but reported as ``False`` (invariant 9).

Imported when plugins register: attrs and the standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from foretell.errors import (  # noqa: F401 (defined there, raised by layouts)
    CorruptEntry,
    ForeignEntry,
    NotAFile,
    StoreError,
    UnknownVersion,
)
from foretell.store.entry import Entry, EntryHeader, StoreIdentity


@runtime_checkable
class StorageLayout(Protocol):
    """One model's stored entries under ``root``. Must be safe to call from two threads
    (the tier's spill worker writes while the request thread reads).

    Constructed as ``Layout(root, config, *, identity)``: ``root`` is the cache location as
    the user gave it, a directory, or a URL for a layout registered for its scheme
    (``register(..., schemes=("redis",))``: :func:`url_scheme`); ``config`` is an instance
    of the attrs class the layout registered (``None`` means its defaults); ``identity``
    says whose entries it serves, and a layout never returns an entry of another identity,
    format version or unloaded codec provider (invariant 7).

    The tier and ``foretell cache`` use this contract and the optional ones below
    (:class:`KeepsRestoreReserve`, :class:`RecordsDeviceDigests`, :class:`ReportsSkipped`,
    :class:`LocatesEntries`, :class:`ReportsDropped`, :class:`FindsPrefixes`,
    :class:`LimitsCapacity`), nothing else of a layout.
    """

    identity: StoreIdentity
    #: I/O failures since the layout opened (disk full, unwritable...); the tier reports it.
    io_failures: int

    def __init__(self, root: str | Path, config: Any, *, identity: StoreIdentity) -> None: ...

    def key_for(self, tokens: Sequence[int], namespace: str = "") -> str:
        """The key ``write`` stores this prompt state under; equal states get equal keys, so
        rewriting one replaces it instead of adding a duplicate."""

    def write(self, entry: Entry) -> bool:
        """Store ``entry`` atomically under ``key_for(entry.tokens, entry.namespace)``.

        True only once the entry is durable (a crash afterwards cannot lose it). An I/O
        failure leaves no partial entry and the previous version intact, and returns False
        (warning once per outage); it never raises for I/O.
        """

    def read(self, key: str) -> Entry | None:
        """The entry under ``key``, every byte verified (header hash, every tensor or block
        checksum) before any array is returned; None when absent, damaged (then deleted),
        foreign or of an unknown version. A successful read marks the entry recently used."""

    def scan(self) -> list[EntryHeader]:
        """Rebuild the index from stored headers (no tensor bytes): reap interrupted writes,
        delete corrupt entries, skip foreign ones. Least recently used first."""

    def headers(self) -> list[EntryHeader]:
        """The index as of the last ``scan``/``write``/``remove`` (scans once if needed)."""

    def remove(self, key: str) -> bool:
        """Delete one entry; True if something was removed."""

    def collect(self) -> int:
        """Garbage-collect storage no servable entry uses (interrupted writes, unreferenced
        blocks); returns bytes freed. Never removes a servable entry: eviction is the tier's."""

    def bytes(self) -> int:
        """Bytes on disk of the entries this layout serves (what the tier's cap counts)."""


@runtime_checkable
class KeepsRestoreReserve(Protocol):
    """A layout that keeps a restore reserve (:class:`foretell.store.reserve.BufferReserve`):
    buffers filled before a restore needs them, so its read pays no zero fill. The tier calls
    ``replenish`` where MLX runs and no request waits: right after it opens (its index
    scanned) and at the end of each request."""

    def replenish(self) -> None:
        """Fill the reserve up to what the largest stored entry needs (within its cap), if
        it holds less; a no-op when it holds enough or is off."""


@runtime_checkable
class RecordsDeviceDigests(Protocol):
    """A layout that records the device digests an entry carries (``Entry.digests``,
    :mod:`foretell.store.digest`) and checks reads by them where the bytes land. The tier
    computes digests only for such a layout: for another they would be GPU work thrown
    away at every write."""

    records_device_digests: bool


@runtime_checkable
class ReportsSkipped(Protocol):
    """A layout that says which stored entries it passes over and why: another model's or
    tokenizer's, an unknown format version, a codec provider this process has not loaded,
    a file that is not a regular file (a FIFO, a directory) or cannot be read.
    Such entries are never served and never deleted (another foretell, or this one with the
    plugin that wrote them, may serve them); ``foretell cache ls|stats|verify|clear`` count
    them, so a directory that seems empty says why."""

    #: Entry location (:class:`LocatesEntries`; a file path for the built-in layouts) ->
    #: why, as found since the last ``scan`` (reads add to it).
    skipped: dict[str, str]


@runtime_checkable
class LocatesEntries(Protocol):
    """A layout that says where each entry lives, so ``foretell cache`` can name it: a
    file's path for both built-in layouts, whatever names the place for another (a URL, a
    key in a bucket). Without it the commands name an entry ``<layout>:<key>``. A layout
    that also keeps ``skipped`` (:class:`ReportsSkipped`) keys it by these same strings."""

    def location(self, key: str) -> str:
        """Where the entry under ``key`` lives (whether or not it exists)."""


@runtime_checkable
class ReportsDropped(Protocol):
    """A layout that says which entries it deleted as damaged since its last ``scan``
    began (the scan's header checks, or a read's checksums), so ``foretell cache verify``
    reports them as bad whichever found them. Both built-in layouts do."""

    #: Entry key -> why it was deleted, since the last ``scan`` began.
    dropped: dict[str, str]


@runtime_checkable
class FindsPrefixes(Protocol):
    """A layout that several processes share and that can say, in one round trip, which
    stored entry holds the most leading tokens of a prompt, among those any process stored
    (another replica's, written after this process's last ``scan``). The tier's lookup asks
    it whenever it may serve more than RAM does, and matches what it returns with the same
    rules as its index (the layout proposes, the tier decides)."""

    def prefixes(self, prompt: Sequence[int], namespace: str, beyond: int
                 ) -> list[EntryHeader]:
        """Headers of stored entries of ``namespace`` that may serve more than ``beyond``
        leading tokens of ``prompt`` (at the layout's granularity: whole blocks), longest
        first; ``[]`` when none does or the store cannot be reached (never raises for I/O)."""


@runtime_checkable
class LimitsCapacity(Protocol):
    """A layout over a store with a size limit of its own (a Redis server's ``maxmemory``):
    the tier's byte cap is the smaller of its own and ``capacity()``, so the tier evicts
    least recently used entries before the store has to evict anything of its own accord."""

    def capacity(self) -> int | None:
        """The most bytes this layout's entries should take (None: no limit of its own).
        Cheap: the value as of the last ``scan``."""


#: ``scheme://`` at the start of a cache location: a URL, not a directory (a scheme of
#: two letters at least: ``C://`` is a Windows drive).
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")


def url_scheme(location: str | Path | None) -> str | None:
    """The scheme of a cache location given as a URL (``redis://host:6379/0`` ->
    ``"redis"``, lowercased); None for a directory. A layout registered for that scheme
    serves it (``Registry.layout_for``)."""
    if location is None or isinstance(location, Path):
        return None
    found = _URL.match(str(location).strip())
    return found.group(1).lower() if found else None


class ScanJournal:
    """What changed in an index while a scan rebuilt it, so the scan does not undo it.

    A scan lists the directory, reads what it finds, then replaces the index whole; an
    entry another thread removed or wrote meanwhile would come back, or go missing, with
    the swap. Each scan opens a journal (:meth:`begin`) before it lists, every change to
    the index is recorded into the open ones (:meth:`record`), and the scan applies its
    journal over what it found before it swaps (:meth:`finish`). All three run under the
    index owner's lock; the scan's reading does not. Scans may overlap: each has its own.
    """

    def __init__(self) -> None:
        self._open: list[dict[str, tuple[Any, bool]]] = []

    def begin(self) -> dict[str, tuple[Any, bool]]:
        changes: dict[str, tuple[Any, bool]] = {}
        self._open.append(changes)
        return changes

    def record(self, key: str, value: Any, *, if_present: bool = False) -> None:
        """``value`` now stands for ``key`` (``None``: removed). ``if_present``: an update
        of an entry (its last use), which must not bring back one the scan found gone."""
        for changes in self._open:
            changes[key] = (value, if_present)

    def finish(self, changes: dict[str, tuple[Any, bool]], found: dict[str, Any]
               ) -> dict[str, Any]:
        """``found`` with the changes made since :meth:`begin` applied; closes the journal."""
        self._open = [open_ for open_ in self._open if open_ is not changes]
        for key, (value, if_present) in changes.items():
            if value is None:
                found.pop(key, None)
            elif not if_present or key in found:
                found[key] = value
        return found
