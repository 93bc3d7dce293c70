"""The ``single-file`` storage layout: one safetensors file per cache entry.

Files are the database: ``<root>/<model fingerprint>-<kv scheme>/<key>.safetensors``, where
the key is derived from the identity, namespace and tokens (so rewriting the same prompt
state replaces its file). The in-memory index is rebuilt from headers by :meth:`scan`.

Rules kept here (DESIGN.md §4): writes are atomic (tmp, fsync, rename, fsync the directory)
and report success only once durable (8, 9); every read verifies the header hash and every
tensor checksum and serves nothing it cannot verify (7, 8); I/O failures warn once and
never raise into the caller (9). It only stores: byte caps and eviction are the cache tier's
(:mod:`foretell.cache.tier`); the layout counts bytes and removes what it is told to.

Registered at plugin load, so this module imports only attrs and the standard library.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from foretell.store import format as fmt
from foretell.store.entry import Entry, EntryHeader, LayerState, StoreIdentity, entry_key
from foretell.store.files import (
    FileVersion,
    NotAFile,
    RootGuard,
    Scanned,
    file_version,
    fsync_directory,
    full_fsync,
    log_io_failure,
    make_directories,
    open_regular,
    rescan,
    unlink_quietly,
)
from foretell.store.layout import ScanJournal

log = logging.getLogger("foretell.store")

def _at_least(lo: float):
    def check(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < lo:
            # Imported on failure only: foretell.config pulls in cattrs.
            from foretell.config import FieldError

            raise FieldError(attribute.name, f"must be a number >= {lo}, got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class SingleFileConfig:
    """``[cache]`` options of the ``single-file`` layout (the byte cap is the tier's)."""

    orphan_age_s: float = attrs.field(
        default=60.0, validator=_at_least(0),
        metadata={"help": "a .tmp file older than this is a crashed write and is deleted on "
                          "scan (younger ones may be another process's write in flight)"},
    )


class SingleFileLayout:
    """One model's entries under ``root``; safe to share between threads of one process.
    Conforms to :class:`foretell.store.layout.StorageLayout`."""

    def __init__(self, root: str | Path, config: SingleFileConfig | None = None, *,
                 identity: StoreIdentity):
        self.config = config if config is not None else SingleFileConfig()
        self.identity = identity
        self.directory = Path(root) / identity.directory
        #: Writes and deletes only while the directory lies inside the root (no link out).
        self._guard = RootGuard(root, self.directory)
        self._index: dict[str, EntryHeader] | None = None
        self._journal = ScanJournal()
        #: file name -> (its version when last scanned, its header or why it is skipped).
        self._scanned: dict[str, Scanned] = {}
        self._lock = threading.Lock()
        self._warned = False
        #: I/O failures since this layout opened (disk full, unwritable, read-only...).
        self.io_failures = 0
        #: Entry files passed over since the last scan, and why (ReportsSkipped).
        self.skipped: dict[str, str] = {}
        #: Entries deleted as damaged since the last scan began, and why (ReportsDropped).
        self.dropped: dict[str, str] = {}

    # -- keys and paths ----------------------------------------------------------------

    def key_for(self, tokens: Sequence[int], namespace: str = "") -> str:
        return entry_key(self.identity, namespace, tokens, fmt.FORMAT_VERSION)

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{fmt.SUFFIX}"

    def location(self, key: str) -> str:
        """The entry's file (``LocatesEntries``)."""
        return str(self.path(key))

    # -- the layout contract -------------------------------------------------------------

    def write(self, entry: Entry) -> bool:
        """Store ``entry`` atomically; True only once it is durable on disk.

        Never raises for I/O: a failure (disk full, unwritable, read-only) leaves no partial
        file, warns once per outage and returns False.
        """
        if not self._guard.allows():
            return False
        writer = fmt.EntryWriter(entry, self.identity, created_at=time.time())
        key = self.key_for(entry.tokens, entry.namespace)
        path = self.path(key)
        # A unique tmp name: two writers of the same key never interleave bytes in one file.
        tmp = self.directory / f"{key}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            make_directories(self.directory)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                         0o644)
            try:
                writer.write_to(fd)
                full_fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            stat = os.stat(path)
        except OSError as exc:
            unlink_quietly(tmp)
            self._io_failed(exc, f"write cache entry {path.name}")
            return False
        except BaseException:
            unlink_quietly(tmp)
            raise
        header = EntryHeader(
            key=key, tokens=tuple(entry.tokens), namespace=entry.namespace,
            layers=writer.stored_layers(),
            nbytes=stat.st_size, last_used=stat.st_mtime,
        )
        with self._lock:
            if self._index is not None:
                self._index[key] = header
            self._journal.record(key, header)
        # The rename is durable only once the directory entry is on disk (invariant 9).
        durable = self._fsync_directory()
        if durable:
            self._warned = False  # the outage is over: warn again if a new one starts
        return durable

    def read(self, key: str) -> Entry | None:
        """The entry stored under ``key``, every byte verified; None if absent or unusable.

        A corrupt or truncated file is deleted so it is never read again; a file of another
        format version, model, tokenizer or codec is left alone and not served.
        """
        verified = self._open_verified(key, with_tensors=True)
        if verified is None:
            return None
        header, _stat, layers = verified
        path = self.path(key)
        try:
            os.utime(path)  # last use drives eviction, and survives restarts with the file
            last_used = os.stat(path).st_mtime
        except OSError:
            last_used = time.time()
        with self._lock:
            if self._index is not None and key in self._index:
                self._index[key] = attrs.evolve(self._index[key], last_used=last_used)
                self._journal.record(key, self._index[key], if_present=True)
        return Entry(tokens=header.tokens, layers=layers, namespace=header.namespace)

    def read_layers(self, key: str, *, verify: bool = True) -> list[LayerState]:
        """The entry's tensors read as :meth:`read` reads them (header, identity and key
        checked); ``verify=False`` skips only the tensors' checksums. For the cache
        benchmark's verified-vs-unverified row: serving reads through :meth:`read`, which
        always verifies and deletes what fails; this deletes nothing and bumps no last use.

        :raises CorruptEntry: the file is damaged. :raises FileNotFoundError: no such entry.
        """
        with open_regular(self.path(key)) as fh:
            header, _stat = self._checked_header(fh, key)
            return fmt.read_layers(fh, header, verify=verify)

    def files(self, key: str) -> list[Path]:
        """The files a read of ``key`` opens: its one file (the benchmark's ``dd`` reads it)."""
        return [self.path(key)]

    def scan(self) -> list[EntryHeader]:
        """Rebuild the index from the files' headers (no tensor bytes are read).

        Deletes crashed writes' ``.tmp`` files and corrupt entries; skips, and keeps, entries
        of another format version or identity. Returns the servable entries, least recently
        used first. A file this layout read at an earlier scan whose inode, size and mtime are
        unchanged is not read again (a rewrite renames a new file in, a read bumps the mtime),
        so rescanning a directory of unchanged entries costs a ``stat`` each.
        """
        with self._lock:
            changes = self._journal.begin()  # before the listing: what lands after it counts
            self.dropped = {}
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            names = []
        except OSError as exc:
            self._io_failed(exc, f"list cache directory {self.directory}")
            names = []
        now = time.time()
        if any(name.endswith(".tmp") for name in names) and self._guard.allows():
            for name in names:
                if name.endswith(".tmp"):
                    self._reap_orphan(self.directory / name, now)
        found, scanned, skipped = rescan(self.directory, names, fmt.SUFFIX, self._scanned,
                                         self._scan_file)
        with self._lock:
            self._index = self._journal.finish(changes, found)
            self._scanned = scanned
            self.skipped = skipped
            return sorted(self._index.values(), key=lambda h: h.last_used)

    def _scan_file(self, key: str, version: FileVersion) -> Scanned | None:
        """One file's header read and checked: what a later scan reuses while the file is
        unchanged (the header, or why it is skipped); None when it was unusable (deleted if
        corrupt) or could not be read."""
        verified = self._open_verified(key, with_tensors=False)
        if verified is None:
            reason = self.skipped.get(str(self.path(key)))
            return None if reason is None else (version, reason)
        header, stat, _ = verified
        return file_version(stat), EntryHeader(
            key=key, tokens=header.tokens, namespace=header.namespace, layers=header.layers,
            nbytes=stat.st_size, last_used=stat.st_mtime)

    def headers(self) -> list[EntryHeader]:
        """The index, least recently used first (scans once if it was never built)."""
        return sorted(self._headers(), key=lambda h: h.last_used)

    def __iter__(self) -> Iterator[EntryHeader]:
        return iter(self.headers())

    def __len__(self) -> int:
        return len(self._headers())

    def remove(self, key: str) -> bool:
        """Delete the entry; True if a file was removed."""
        self._forget(key)
        if not self._guard.allows():
            return False
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._io_failed(exc, f"delete cache entry {key}")
            return False
        return True

    def collect(self) -> int:
        """Delete interrupted writes' ``.tmp`` files older than ``orphan_age_s``; returns the
        bytes freed. Servable entries are never touched (eviction is the tier's)."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return 0
        if not self._guard.allows():
            return 0
        now = time.time()
        return sum(self._reap_orphan(self.directory / n, now) for n in names if n.endswith(".tmp"))

    def bytes(self) -> int:
        """Bytes on disk of the entries this layout serves."""
        return sum(h.nbytes for h in self._headers())

    # -- internals -------------------------------------------------------------------------

    def _headers(self) -> list[EntryHeader]:
        with self._lock:
            index = self._index
            if index is not None:
                return list(index.values())
        return self.scan()

    def _open_verified(self, key: str, *, with_tensors: bool
                       ) -> tuple[fmt.StoredHeader, os.stat_result, list | None] | None:
        path = self.path(key)
        try:
            with open_regular(path) as fh:
                header, stat = self._checked_header(fh, key)
                layers = fmt.read_layers(fh, header) if with_tensors else None
            return header, stat, layers
        except FileNotFoundError:
            self._forget(key)
        except fmt.CorruptEntry as exc:
            self._forget(key)
            self.dropped[key] = str(exc)
            deleted = self._guard.allows() and unlink_quietly(path)
            log.warning("cache entry %s is corrupt (%s); %s", path, exc,
                        "deleted" if deleted else "not deleted")
        except (fmt.UnknownVersion, fmt.ForeignEntry, NotAFile) as exc:
            log.debug("cache entry %s skipped: %s", path, exc)
            self.skipped[str(path)] = str(exc)
            self._forget(key)
        except fmt.FileReplaced:  # another process rewrote or evicted it meanwhile
            log.debug("cache entry %s changed while it was read; not served", path)
        except OSError as exc:
            # Kept as skipped, so a scan warns once per version of the file, not each time.
            log.warning("cannot read cache entry %s: %s", path, exc)
            self.skipped[str(path)] = f"cannot be read ({exc.strerror or exc})"
        return None

    def _checked_header(self, fh: Any, key: str) -> tuple[fmt.StoredHeader, os.stat_result]:
        stat = os.fstat(fh.fileno())
        header = fmt.read_header(fh, stat.st_size, self.identity)
        # A renamed or copied file must not answer for a prompt it does not hold.
        if self.key_for(header.tokens, header.namespace) != key:
            raise fmt.CorruptEntry("its name does not match the tokens it holds")
        return header, stat

    def _forget(self, key: str) -> None:
        with self._lock:
            self._scanned.pop(self.path(key).name, None)
            self._journal.record(key, None)
            if self._index is not None:
                self._index.pop(key, None)

    def _reap_orphan(self, path: Path, now: float) -> int:
        try:
            stat = os.stat(path)
            if now - stat.st_mtime >= self.config.orphan_age_s:
                os.unlink(path)
                log.info("deleted %s, left by an interrupted write", path)
                return stat.st_size
        except OSError:
            pass  # gone already, or not ours to delete: either way it is never served
        return 0

    def _fsync_directory(self) -> bool:
        try:
            fsync_directory(self.directory)
        except OSError as exc:
            self._io_failed(exc, f"sync cache directory {self.directory}")
            return False
        return True

    def _io_failed(self, exc: OSError, action: str) -> None:
        self.io_failures += 1
        self._warned = log_io_failure(exc, action, warned=self._warned)
