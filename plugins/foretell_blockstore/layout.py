"""The ``blocks`` storage layout: entries as manifests over shared, content-named blocks.

On disk, under ``<root>/<model fingerprint>-<kv scheme>/blocks-v4/``::

    entries/<key>.safetensors   one manifest per entry (a tensor-less safetensors file)
    data/<xxh3-128>.blk         one block: rows of a token range, every layer back to back
    lock                        flock(2) target: writers shared, collect() exclusive

Rules kept (DESIGN.md §4): a block is written tmp → fsync → rename and never rewritten
once it exists; the manifest lands the same way only after every block it lists is durable
(so no crash leaves a manifest with a missing block); every read verifies the manifest hash
and every block's size and checksum before an array is returned, and drops an entry it cannot
verify with one warning (7, 8); I/O failures warn once per outage and never raise (9);
``bytes()`` counts each unique block once (10). ``collect()`` deletes blocks no manifest
lists while holding the directory's lock exclusively, and a writer holds it shared from its
first block to its manifest's rename, so a concurrent writer's blocks are never collected
(docs/block-store.md).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs
import xxhash

from foretell.config import number, whole_number
from foretell.platform import device
from foretell.store import digest
from foretell.store import format as fmt
from foretell.store import reserve as rsv
from foretell.store.entry import (
    Entry,
    EntryHeader,
    LayerHeader,
    LayerState,
    StoreIdentity,
    entry_key,
)
from foretell.store.files import (
    FileVersion,
    NotAFile,
    RootGuard,
    Scanned,
    fsync_directory,
    log_io_failure,
    make_directories,
    read_bounded,
    rescan,
    unlink_quietly,
)
from foretell.store.layout import (
    CorruptEntry,
    ForeignEntry,
    ScanJournal,
    StoreError,
    UnknownVersion,
)
from foretell_blockstore import blockfile
from foretell_blockstore import manifest as mf

if TYPE_CHECKING:
    from foretell.platform import cuda

log = logging.getLogger("foretell.store")

SUFFIX = ".safetensors"
BLOCK_SUFFIX = ".blk"
#: entry_key's format version for this layout (keys never collide with another format's).
KEY_VERSION = 102
#: One directory per block format version: another version's manifests are never seen,
#: so they are never served and their blocks never collected by this one.
STORE_DIR = "blocks-v4"


_positive, _non_negative = whole_number(1), number(0)


def _megabytes_or_none(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _non_negative(inst, attribute, value)


@attrs.frozen(kw_only=True)
class BlockStoreConfig:
    """``[cache]`` options of the ``blocks`` layout."""

    block_tokens: int = attrs.field(
        default=512, validator=_positive,
        metadata={"help": "tokens (rows) per block; entries sharing a prefix share whole "
                          "blocks of this many tokens"},
    )
    lock_timeout_s: float = attrs.field(
        default=5.0, validator=_non_negative,
        metadata={"help": "how long collect() waits for in-flight writes before skipping "
                          "a round"},
    )
    restore_reserve_mb: float | None = attrs.field(
        default=None, validator=_megabytes_or_none,
        metadata={"help": "megabytes of buffers kept filled for the next restore (0: off; "
                          "default: FORETELL_RESTORE_RESERVE_MB, else 1024 on a CPU, 4096 on "
                          "a CUDA GPU); it holds at most the largest stored entry"},
    )


@attrs.frozen
class Usage:
    """What ``foretell cache stats`` shows for this layout."""

    entries: int
    blocks: int
    #: Bytes the entries would take stored whole (each manifest plus all its blocks).
    logical_bytes: int
    #: Bytes on disk of what the entries use: manifests plus each unique block once.
    disk_bytes: int
    #: Bytes of block files no indexed entry uses (other processes' entries, or garbage
    #: until the next collect()).
    unreferenced_bytes: int

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.disk_bytes if self.disk_bytes else 1.0


@attrs.frozen
class _Indexed:
    header: EntryHeader
    manifest_bytes: int
    blocks: tuple[mf.BlockRef, ...]
    #: What a read of it takes from the restore reserve (mf.buffer_bytes).
    buffer_bytes: int = 0
    #: Its largest tensor's bytes (what a device digest of its tensors must be ready for).
    largest_tensor: int = 0
    #: What landing it whole takes of a landing area (mf.landing_bytes).
    landing_bytes: int = 0


class BlockStoreLayout:
    """One model's entries under ``root``; safe to share between threads and processes.
    Conforms to :class:`foretell.store.layout.StorageLayout`, keeps a restore reserve and
    records device digests (``KeepsRestoreReserve``, ``RecordsDeviceDigests``)."""

    #: Manifests hold the digests an entry carries; reads on a CUDA GPU check them.
    records_device_digests = True

    def __init__(self, root: str | Path, config: BlockStoreConfig | None = None, *,
                 identity: StoreIdentity):
        self.config = config if config is not None else BlockStoreConfig()
        self.identity = identity
        self.directory = Path(root) / identity.directory / STORE_DIR
        self.entries_dir = self.directory / "entries"
        self.data_dir = self.directory / "data"
        #: Writes and deletes only while these lie inside the root (no link out).
        self._guard = RootGuard(root, self.entries_dir, self.data_dir)
        self._index: dict[str, _Indexed] | None = None
        self._journal = ScanJournal()
        #: manifest name -> (its bytes' XXH3-128, block ids), so collect() parses only
        #: manifests that changed since the last one.
        self._parsed: dict[str, tuple[int, frozenset[str]]] = {}
        #: key -> (a manifest file's bytes, what they parsed to), see _load_manifest.
        self._manifests: dict[str, tuple[bytes, mf.Manifest]] = {}
        #: manifest name -> (its version when last scanned, its entry or why it is skipped).
        self._scanned: dict[str, Scanned] = {}
        self._lock = threading.Lock()
        self._warned = False
        #: I/O failures since this layout opened (disk full, unwritable, read-only...).
        self.io_failures = 0
        #: Manifests passed over since the last scan, and why (ReportsSkipped).
        self.skipped: dict[str, str] = {}
        #: Entries dropped as damaged since the last scan began, and why (ReportsDropped).
        self.dropped: dict[str, str] = {}
        #: Block bytes this layout wrote / found already stored (the benchmark reads them).
        self.bytes_written = 0
        self.bytes_reused = 0
        # Parsed now, so a bad FORETELL_RESTORE_RESERVE_MB fails as the store opens.
        self._reserve_cap = (rsv.env_cap() if self.config.restore_reserve_mb is None
                             else int(self.config.restore_reserve_mb * rsv.MiB))
        #: Buffers filled before a restore needs them (replenish); None until the first.
        self.reserve: rsv.BufferReserve | None = None
        #: Where the last read's time went, ms per step in order (manifest, buffers,
        #: queued, blocks, digests, arrays); the cache benchmark reports it for fresh
        #: processes, with what checked the bytes of the last read.
        self.last_read_ms: dict[str, float] = {}
        #: Where the last replenish's time went, ms per step (digests, landing, reserve).
        self.last_replenish_ms: dict[str, float] = {}
        self.last_check = ""
        # Where an engine runs (MLX loaded; `foretell cache ls` loads none), the CUDA driver
        # is loaded and its staging pinned as the store opens, not by the first restore.
        if "mlx.core" in sys.modules:
            cuda = device.cuda_backend()
            if cuda is not None:
                cuda.driver.gpu_landing()

    @classmethod
    def stored_identities(cls, root: str | Path, codec_providers: Sequence[str]
                          ) -> list[StoreIdentity]:
        """Every identity some manifest under ``root`` claims (``foretell cache`` without
        ``--model`` acts on each); damaged manifests claim nothing. A store left with blocks
        but no manifest gets an identity serving nothing, so ``collect()`` still frees it."""
        seen = {}
        for store in sorted(Path(root).glob(f"*/{STORE_DIR}/data")):
            fingerprint, _, scheme = store.parent.parent.name.partition("-")
            with contextlib.suppress(ValueError):
                seen[(store.parent.parent.name, "", "")] = StoreIdentity(
                    model_fingerprint=fingerprint, kv_scheme=scheme or "plain", model_id="",
                    tokenizer_hash="", codec_providers=codec_providers)
        for path in sorted(Path(root).glob(f"*/{STORE_DIR}/entries/*{SUFFIX}")):
            try:
                fields = mf.parse(read_bounded(path, mf.MAX_MANIFEST_BYTES, "a manifest")).fields
                identity = StoreIdentity(
                    model_fingerprint=fields["model_fingerprint"],
                    kv_scheme=fields["kv_scheme"], model_id=fields["model_id"],
                    tokenizer_hash=fields["tokenizer_hash"], codec_providers=codec_providers)
            except (OSError, StoreError, KeyError, TypeError, ValueError):
                continue
            if identity.directory == path.parent.parent.parent.name:
                seen.pop((identity.directory, "", ""), None)
                seen[(identity.directory, identity.model_id, identity.tokenizer_hash)] = identity
        return list(seen.values())

    # -- keys and paths ----------------------------------------------------------------

    def key_for(self, tokens: Sequence[int], namespace: str = "") -> str:
        return entry_key(self.identity, namespace, tokens, KEY_VERSION)

    def path(self, key: str) -> Path:
        return self.entries_dir / f"{key}{SUFFIX}"

    def location(self, key: str) -> str:
        """The entry's manifest (``LocatesEntries``)."""
        return str(self.path(key))

    def block_path(self, block_id: str) -> Path:
        return self.data_dir / f"{block_id}{BLOCK_SUFFIX}"

    # -- the layout contract -------------------------------------------------------------

    def write(self, entry: Entry) -> bool:
        """Store ``entry``: its new blocks, then its manifest, each atomically. True only
        once the manifest is durable; an I/O failure warns once and returns False."""
        if not self._guard.allows():
            return False
        key = self.key_for(entry.tokens, entry.namespace)
        groups = mf.plan_groups(entry)
        rows = self.config.block_tokens
        tmp = self.entries_dir / f"{key}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            with self._flock(exclusive=False):
                make_directories(self.entries_dir)
                make_directories(self.data_dir)
                area, sources = self._gather_by_dma(entry, groups, rows)
                try:
                    jobs = [(group, [fmt.write_pool().submit(self._store_block, sources,
                                                             group, b, e)
                                     for b, e in group.spans(rows)]) for group in groups]
                    # Every job finishes before the lock is released, failed or not.
                    futures.wait([job for _group, group_jobs in jobs for job in group_jobs])
                finally:
                    if area is not None:
                        area.release()
                listed = [(group, [job.result() for job in group_jobs])
                          for group, group_jobs in jobs]
                for _group, stored in listed:
                    for ref, new in stored:
                        if new:
                            self.bytes_written += ref.nbytes
                        else:
                            self.bytes_reused += ref.nbytes
                listed = [(group, [ref for ref, _new in stored]) for group, stored in listed]
                # The blocks' names are durable before a manifest can list them: also the
                # ones found stored, which another writer may have renamed in and not yet
                # made durable (or failed to).
                fsync_directory(self.data_dir)
                raw = mf.render(entry, self.identity, rows, time.time(), listed)
                blockfile.write_durably(tmp, raw)
                os.replace(tmp, self.path(key))
                fsync_directory(self.entries_dir)
                stat = os.stat(self.path(key))
        except OSError as exc:
            unlink_quietly(tmp)
            self._io_failed(exc, f"write cache entry {key}")
            return False
        except BaseException:
            unlink_quietly(tmp)
            raise
        blocks = tuple(ref for _g, refs in listed for ref in refs)
        indexed = _Indexed(
            header=EntryHeader(
                key=key, tokens=tuple(entry.tokens), namespace=entry.namespace,
                layers=tuple(LayerHeader(codec=la.codec, provider=la.provider,
                                         meta=json.loads(json.dumps(dict(la.meta))))
                             for la in entry.layers),
                nbytes=stat.st_size + sum(r.nbytes for r in blocks), last_used=stat.st_mtime),
            manifest_bytes=stat.st_size, blocks=blocks, buffer_bytes=mf.buffer_bytes(groups),
            largest_tensor=mf.largest_tensor(groups), landing_bytes=mf.landing_bytes(blocks))
        with self._lock:
            if self._index is not None:
                self._index[key] = indexed
            self._journal.record(key, indexed)
        self._warned = False
        return True

    def read(self, key: str) -> Entry | None:
        """The entry under ``key`` assembled from its blocks, each verified; None when
        absent, foreign, of another version, or damaged (then dropped with one warning)."""
        path = self.path(key)
        raw = None
        try:
            started = time.perf_counter()
            raw = self._manifest_bytes(key)
            manifest = self._manifest_of(key, raw)
            layers = self._assemble(manifest, started=started)
        except FileNotFoundError:
            self._forget(key)
            return None
        except blockfile.BadBlock as bad:
            self._drop(key, bad.reason, raw, bad_block=bad.block_id)
            return None
        except CorruptEntry as exc:
            self._drop(key, str(exc), raw)
            return None
        except (UnknownVersion, ForeignEntry, NotAFile) as exc:
            log.debug("cache entry %s skipped: %s", path, exc)
            self.skipped[str(path)] = str(exc)
            self._forget(key)
            return None
        except OSError as exc:
            log.warning("cannot read cache entry %s: %s", path, exc)
            return None
        try:
            os.utime(path)  # last use drives the tier's eviction, and survives restarts
            last_used = os.stat(path).st_mtime
        except OSError:
            last_used = time.time()
        with self._lock:
            if self._index is not None and key in self._index:
                found = self._index[key]
                self._index[key] = attrs.evolve(
                    found, header=attrs.evolve(found.header, last_used=last_used))
                self._journal.record(key, self._index[key], if_present=True)
        return Entry(tokens=manifest.tokens, layers=layers, namespace=manifest.namespace)

    def replenish(self) -> None:
        """Fill the restore reserve up to the largest indexed entry's buffers (within its
        cap: ``restore_reserve_mb``, ``FORETELL_RESTORE_RESERVE_MB``, the device's default),
        the first time and after a restore took from it; a no-op otherwise, so a
        conversation whose stored entries grow every turn does not pay a fill at each
        request's end. Runs MLX: the tier calls it where MLX runs and no request waits
        (:class:`foretell.store.layout.KeepsRestoreReserve`). Where reads are checked by
        device digests, their kernel is loaded (or their weights built) here too, and on a
        CUDA GPU the landing area is grown and its kernel loaded."""
        marks, indexed = [time.perf_counter()], self._indexed()
        if digest.enabled():  # even for an empty store: its first write digests too
            digest.prepare(max((i.largest_tensor for i in indexed), default=4) // 4)
        marks.append(time.perf_counter())
        cuda = device.cuda_backend()
        on_gpu = cuda is not None and cuda.driver.gpu_landing()  # born where reads land
        with self._lock:  # engines sharing a tier may finish requests on two threads
            if self.reserve is None:
                cap = (self._reserve_cap if self._reserve_cap is not None
                       else rsv.default_cap(on_gpu))
                if cap == 0:
                    return
                self.reserve = rsv.BufferReserve(cap, on_gpu=on_gpu)
        if cuda is not None:
            self._prepare_landing(cuda, max((i.landing_bytes for i in indexed), default=0))
        marks.append(time.perf_counter())
        if self.reserve.used_since_fill():
            self.reserve.refill(max((i.buffer_bytes for i in indexed), default=0))
        marks.append(time.perf_counter())
        self.last_replenish_ms = {step: (end - begin) * 1e3 for step, begin, end in zip(
            ("digests", "landing", "reserve"), marks, marks[1:])}

    def _prepare_landing(self, cuda: ModuleType, largest: int) -> None:
        """Grow the landing area to ``largest`` bytes (the largest indexed entry's; within
        the reserve's cap) and load its kernel, where no request waits (a no-op once it has
        room). Not while the store holds nothing to restore: a fresh cache directory's first
        request would wait for the kernel for no read; the replenish after the request that
        stored its first entry readies it."""
        area = cuda.areas.landing()
        if area is None or largest <= 0:
            return
        try:
            area.prepare(min(largest, self._landing_cap()))
        except cuda.driver.CudaCopyError as exc:  # no device memory: reads land piece by piece
            log.debug("block store %s: landing area not grown (%s)", self.directory, exc)
        except RuntimeError as exc:
            cuda.areas.give_up_landing(exc)

    def read_layers(self, key: str, *, verify: bool = True) -> list[LayerState]:
        """The entry's tensors read as :meth:`read` reads them (manifest, identity and key
        checked, each block's size and header compared, pieces straight into the buffers);
        ``verify=False`` skips only the pieces' checksums. For the cache benchmark's
        verified-vs-unverified row (as ``foretell.store.format.read_layers`` is for the
        single-file layout): serving reads through :meth:`read`, which always verifies and
        drops what fails; this drops nothing and bumps no last use.

        :raises CorruptEntry: the manifest or a block is damaged (or fails its checksum).
        :raises FileNotFoundError: no such entry.
        """
        started = time.perf_counter()
        manifest = self._load_manifest(key)
        try:
            return self._assemble(manifest, verify=verify, started=started)
        except blockfile.BadBlock as bad:
            raise CorruptEntry(bad.reason) from None

    def files(self, key: str) -> list[Path]:
        """The files a read of ``key`` opens: its manifest, then its blocks in read order
        (the benchmark reads the same bytes with ``dd``).

        :raises CorruptEntry: the manifest is damaged. :raises FileNotFoundError: absent.
        """
        manifest = self._load_manifest(key)
        return [self.path(key), *(self.block_path(ref.id) for ref in manifest.blocks)]

    def scan(self) -> list[EntryHeader]:
        """Rebuild the index from manifests (no block bytes are read): drops entries whose
        manifest is corrupt or whose blocks are missing, skips foreign ones, and reaps
        interrupted writes when no write is in flight. Least recently used first. A manifest
        this layout read at an earlier scan whose inode, size and mtime are unchanged is not
        read again, nor are its blocks looked for (reads check them), so rescanning a
        directory of unchanged entries costs a ``stat`` each."""
        self._reap_interrupted_writes()
        with self._lock:
            changes = self._journal.begin()  # before the listing: what lands after it counts
            self.dropped = {}
        found, scanned, skipped = rescan(self.entries_dir, self._listdir(self.entries_dir),
                                         SUFFIX, self._scanned, self._scan_manifest)
        with self._lock:
            self._index = found = self._journal.finish(changes, found)
            self._scanned = scanned
            self.skipped = skipped
            self._manifests = {k: v for k, v in self._manifests.items() if k in found}
            return sorted((i.header for i in found.values()), key=lambda h: h.last_used)

    def _scan_manifest(self, key: str, version: FileVersion) -> Scanned | None:
        """One manifest read and checked, its blocks looked for: what a later scan reuses
        while the file is unchanged (the entry, or why it is skipped); None when it was
        unusable (dropped if damaged) or could not be read. ``version`` was taken before the
        bytes are read, so a manifest replaced in between is read again next time."""
        raw = None
        _inode, size, mtime_ns = version
        try:
            raw = self._manifest_bytes(key)
            manifest = self._manifest_of(key, raw)
            missing = next((r.id for r in manifest.blocks
                            if not os.path.exists(self.block_path(r.id))), None)
            if missing is not None:
                raise blockfile.BadBlock(missing, f"block {missing[:16]} is missing")
        except FileNotFoundError:
            return None
        except blockfile.BadBlock as bad:
            self._drop(key, bad.reason, raw)
            return None
        except CorruptEntry as exc:
            self._drop(key, str(exc), raw)
            return None
        except (UnknownVersion, ForeignEntry, NotAFile) as exc:
            log.debug("cache entry %s skipped: %s", self.path(key), exc)
            return version, str(exc)
        except OSError as exc:
            # Kept as skipped while the file is unchanged: a rescan warns once, not each time.
            log.warning("cannot read cache entry %s: %s", self.path(key), exc)
            return version, f"cannot be read ({exc.strerror or exc})"
        return version, _Indexed(
            header=EntryHeader(key=key, tokens=manifest.tokens, namespace=manifest.namespace,
                               layers=manifest.layers, nbytes=size + manifest.tensor_bytes,
                               last_used=mtime_ns / 1e9),
            manifest_bytes=size, blocks=tuple(manifest.blocks),
            buffer_bytes=mf.buffer_bytes(group for group, _refs in manifest.groups),
            largest_tensor=mf.largest_tensor(group for group, _refs in manifest.groups),
            landing_bytes=mf.landing_bytes(manifest.blocks))

    def headers(self) -> list[EntryHeader]:
        """The index, least recently used first (scans once if it was never built)."""
        return sorted((i.header for i in self._indexed()), key=lambda h: h.last_used)

    def __iter__(self) -> Iterator[EntryHeader]:
        return iter(self.headers())

    def __len__(self) -> int:
        return len(self._indexed())

    def remove(self, key: str) -> bool:
        """Delete the entry's manifest; its blocks go at the next ``collect()`` unless
        another entry lists them."""
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
        """Delete blocks no manifest in the directory lists (this identity's or another's)
        and interrupted writes; returns bytes freed. Waits up to ``lock_timeout_s`` for
        in-flight writes to finish, else frees nothing this round."""
        if not self.directory.is_dir() or not self._guard.allows():
            return 0
        try:
            with self._flock(exclusive=True, timeout=self.config.lock_timeout_s):
                freed = self._reap_tmp_files()
                live = self._live_blocks()
                for name in self._listdir(self.data_dir):
                    if name.endswith(BLOCK_SUFFIX) and name[: -len(BLOCK_SUFFIX)] not in live:
                        freed += blockfile.unlink_counting(self.data_dir / name)
                return freed
        except _LockBusy:
            log.info("block store %s is busy with writes; collect() skipped this round",
                     self.directory)
            return 0
        except OSError as exc:  # a read-only store: one warning per outage, writes' included
            self._io_failed(exc, f"delete unused blocks in {self.directory}")
            return 0

    def bytes(self) -> int:
        """Bytes on disk of the entries this layout serves: manifests plus each block they
        use counted once."""
        indexed = self._indexed()
        unique = {ref.id: ref.nbytes for i in indexed for ref in i.blocks}
        return sum(i.manifest_bytes for i in indexed) + sum(unique.values())

    def usage(self) -> Usage:
        """Logical vs on-disk bytes of the indexed entries, and unreferenced block bytes."""
        indexed = self._indexed()
        unique = {ref.id: ref.nbytes for i in indexed for ref in i.blocks}
        on_disk = 0
        for name in self._listdir(self.data_dir):
            if name.endswith(BLOCK_SUFFIX) and name[: -len(BLOCK_SUFFIX)] not in unique:
                with contextlib.suppress(OSError):
                    on_disk += os.stat(self.data_dir / name).st_size
        return Usage(entries=len(indexed), blocks=len(unique),
                     logical_bytes=sum(i.header.nbytes for i in indexed),
                     disk_bytes=sum(i.manifest_bytes for i in indexed) + sum(unique.values()),
                     unreferenced_bytes=on_disk)

    # -- internals -------------------------------------------------------------------------

    def _gather_by_dma(self, entry: Entry, groups: tuple[mf.Group, ...], rows: int
                       ) -> tuple[cuda.areas.HostArea | None,
                                  Callable[..., list[list[memoryview]]]]:
        """Where each block's pieces come from: on a CUDA GPU, gathered from the tensors by
        DMA into the process's page-locked write area
        (``foretell.platform.cuda.areas.write_area``) where it is free (the area is
        returned, held: the caller releases it once every block is written), else read from
        the tensors' memory on the CPU (``mf.block_pieces``). Needs every tensor's rows in
        runs at one pitch (``mf.run_layout``), as a cache's are."""
        hosts = mf.host_views(entry)
        on_host = None, functools.partial(mf.block_pieces, hosts)
        cuda = device.cuda_backend()
        area = cuda.areas.write_area() if cuda is not None else None
        if area is None:
            return on_host
        found = {key: mf.run_layout(host) for key, host in hosts.items() if host.size}
        if None in found.values():
            return on_host
        _offsets, need, plan = mf.piece_plan(
            groups, rows, {key: at for key, (at, _pitch) in found.items()},
            {key: pitch for key, (_at, pitch) in found.items()})
        if need > self._landing_cap():  # page-locked memory is held by the area for good
            return on_host
        try:
            if area.acquire(need) is None:
                return on_host
        except cuda.driver.CudaCopyError as exc:
            log.debug("block store %s: no write area of %d bytes (%s)", self.directory,
                      need, exc)
            return on_host
        at, where = 0, {}
        for group in groups:
            for begin, _end in group.spans(rows):
                where[(group, begin)] = plan[at:at + len(group.tensors)]
                at += len(group.tensors)

        def gather(group: mf.Group, begin: int, _end: int) -> list[list[memoryview]]:
            stage, pieces = cuda.driver.staging(), []
            try:
                for offset, first, width, count, pitch in where[(group, begin)].tolist():
                    pieces.append([area.view(offset, width * count)])
                    stage.fetch(pieces[-1][0], first, width, count, pitch)
            finally:
                stage.finish()  # every piece has landed before it is hashed or written
            return pieces

        return area, gather

    def _store_block(self, source: Callable[..., list[list[memoryview]]], group: mf.Group,
                     begin: int, end: int) -> tuple[mf.BlockRef, bool]:
        """Rows ``[begin, end)`` of ``group`` as one block (its pieces from ``source``),
        written unless a block of the same bytes exists (it is never rewritten); runs on the
        pool. True if written."""
        pieces = source(group, begin, end)
        header = mf.block_header(group, begin, end)
        ref = mf.block_ref(header, pieces)
        final = self.block_path(ref.id)
        if os.path.exists(final):
            return ref, False
        tmp = self.data_dir / f"{ref.id}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            blockfile.write_durably(tmp, header, *(run for runs in pieces for run in runs))
            os.replace(tmp, final)  # a racing writer of the same id wrote the same bytes
        except BaseException:
            unlink_quietly(tmp)
            raise
        return ref, True

    def _load_manifest(self, key: str) -> mf.Manifest:
        """The manifest under ``key``, read whole on every call and verified (its header
        hash, identity, and name against its tokens) unless its bytes are exactly those
        this layout verified last time for ``key`` (the scan, an earlier read): the same
        bytes parse and verify the same. A read parses before any block read starts; in a
        fresh process that was 1.2-2.4 ms of a 15 ms restore of the demo's 4,096 tokens on
        the 2-core Xeon (docs/block-store.md)."""
        return self._manifest_of(key, self._manifest_bytes(key))

    def _manifest_bytes(self, key: str) -> bytes:
        """The manifest file's bytes, if it is a regular file of at most
        ``mf.MAX_MANIFEST_BYTES`` (:func:`foretell.store.files.read_bounded`).

        :raises CorruptEntry: larger. :raises NotAFile: a FIFO, device, directory..."""
        return read_bounded(self.path(key), mf.MAX_MANIFEST_BYTES, "a manifest")

    def _manifest_of(self, key: str, raw: bytes) -> mf.Manifest:
        """:meth:`_load_manifest` of bytes read already."""
        known = self._manifests.get(key)
        if known is not None and known[0] == raw:
            return known[1]
        manifest = mf.parse(raw)
        fmt.check_identity(manifest.fields, self.identity)
        # A renamed or copied manifest must not answer for a prompt it does not hold.
        if self.key_for(manifest.tokens, manifest.namespace) != key:
            raise CorruptEntry("its name does not match the tokens it holds")
        self._manifests[key] = (raw, manifest)
        return manifest

    def _assemble(self, manifest: mf.Manifest, *, verify: bool = True,
                  started: float | None = None, on_device: bool = True) -> list[LayerState]:
        """Read every block into its tensors' MLX-owned buffers, blocks in parallel on the
        pool, each checking its header and size; all checks pass before anything is
        returned. The bytes are checked by the manifest's device digests where it has them
        and :func:`foretell.store.digest.enabled` (a CUDA GPU: every tensor digested where
        it landed, after the last block), by each piece's checksum as it lands otherwise
        (``verify=False``: neither, the benchmark's only; ``on_device=False``: the
        checksums). On a CUDA GPU the buffers are born there and the blocks land by DMA
        from page-locked slots (``foretell.platform.cuda``, reached through
        ``device.cuda_backend()``): each slot in one copy to the process's landing area, its
        runs placed into the tensors by one kernel after the last block
        (:meth:`_land_whole`); otherwise, and when the area is held or the entry is larger
        than the restore reserve's cap, each piece's copy lands in place. Elsewhere pieces
        are read straight into the buffers."""

        marks = [started if started is not None else time.perf_counter(), time.perf_counter()]
        cuda = device.cuda_backend()
        staged = cuda is not None and cuda.driver.gpu_landing()
        by_digest = verify and on_device and manifest.digests is not None and digest.enabled()
        specs = manifest.specs
        buffers = {(s.layer, s.name): b for s, b in zip(
            specs, mf.host_buffers(specs, on_gpu=staged, reserve=self.reserve))}
        flats = {key: flat for key, (_array, flat) in buffers.items()}
        marks.append(time.perf_counter())
        check = verify and not by_digest
        landed = None if cuda is None else self._land_whole(cuda, manifest, flats, check, marks)
        if landed is None:
            staging = cuda.driver.staging if staged else None
            jobs = []
            for group, refs in manifest.groups:
                for ref, (begin, end) in zip(refs, group.spans(manifest.block_rows)):
                    jobs.append(fmt.io_pool().submit(
                        blockfile.read_block, self.block_path(ref.id), ref,
                        mf.block_header(group, begin, end),
                        mf.destinations(group, begin, end, flats), check, staging))
            marks.append(time.perf_counter())
            blockfile.wait_in_order(jobs)
            marks.append(time.perf_counter())
        if by_digest:
            found = digest.digests([buffers[(s.layer, s.name)][0] for s in specs],
                                   views=[flats[(s.layer, s.name)] for s in specs])
            bad = next((s for s, got, want in zip(specs, found or [None] * len(specs),
                                                  manifest.digests) if got != want), None)
            if bad is not None:
                self._locate_damage(manifest)
                raise CorruptEntry(f"tensor layers.{bad.layer}.{bad.name} fails its device "
                                   f"digest (every block passes its checksum)")
        self.last_check = ("none" if not verify else f"{digest.SCHEME} on the device"
                           if by_digest else f"{fmt.CHECKSUM} per piece")
        marks.append(time.perf_counter())
        layers = mf.layer_states(manifest, buffers)
        marks.append(time.perf_counter())
        steps = ("manifest", "buffers", "queued", "blocks", *(("placed",) if landed else ()),
                 "digests", "arrays")
        self.last_read_ms = {step: (end - begin) * 1e3 for step, begin, end in zip(
            steps, marks, marks[1:])}
        return layers

    def _landing_cap(self) -> int:
        """The most a landing or write area may hold for this layout: the restore
        reserve's cap."""
        return self._reserve_cap if self._reserve_cap is not None else rsv.default_cap(True)

    def _land_whole(self, cuda: ModuleType, manifest: mf.Manifest,
                    flats: dict[tuple[int, str], memoryview], verify: bool,
                    marks: list[float]) -> bool | None:
        """Read the entry's blocks into the process's landing area (each staging slot one
        copy), then place every run into its tensor in one pass; True once done, None when
        the entry cannot land whole here (no area: not a CUDA GPU; the area held by another
        restore; larger than the restore reserve's cap; no device memory for it; its kernel
        failed, then never again in this process, with one warning).

        :raises blockfile.BadBlock: as :func:`blockfile.read_block`, before anything is placed.
        """
        area = cuda.areas.landing()
        if area is None:
            return None
        offsets, need, runs = mf.landing_plan(
            manifest, {key: cuda.driver.address(flat) for key, flat in flats.items()})
        if need > self._landing_cap():
            return None
        try:
            base = area.acquire(need)
        except cuda.driver.CudaCopyError as exc:
            log.debug("block store %s: no landing area of %d bytes (%s)", self.directory,
                      need, exc)
            return None
        if base is None:
            return None
        try:
            jobs, at = [], 0
            for group, refs in manifest.groups:
                for ref, (begin, end) in zip(refs, group.spans(manifest.block_rows)):
                    jobs.append(fmt.io_pool().submit(
                        blockfile.land_block, self.block_path(ref.id), ref,
                        mf.block_header(group, begin, end),
                        [t.piece_bytes(begin, end) for t in group.tensors], verify,
                        base + offsets[at], cuda.driver.staging))
                    at += 1
            marks.append(time.perf_counter())
            blockfile.wait_in_order(jobs)
            marks.append(time.perf_counter())
            try:
                area.place(runs)
            except RuntimeError as exc:  # the kernel cannot be built or launched here
                cuda.areas.give_up_landing(exc)
                del marks[-2:]
                return None
            marks.append(time.perf_counter())
            return True
        finally:
            area.release()

    def _locate_damage(self, manifest: mf.Manifest) -> None:
        """After a device digest failed: read the blocks again, each checked by its own
        checksum, so a damaged block is named (:class:`blockfile.BadBlock`) and deleted with the
        entry instead of being reused by later writes of the same bytes."""
        self._assemble(manifest, on_device=False)

    def _drop(self, key: str, reason: str, judged: bytes | None, *,
              bad_block: str | None = None) -> None:
        """Never serve this entry again: delete its manifest (and a damaged block, which
        would otherwise be reused by every later write of the same bytes). Only the manifest
        whose bytes were ``judged`` (when they could be read): another process may have
        rewritten the key meanwhile, with other blocks, and collected the old ones that this
        read then found missing; its manifest is not at fault."""
        path = self.path(key)
        self._forget(key)
        if not self._guard.allows():
            return
        if bad_block is not None and "missing" not in reason:
            unlink_quietly(self.block_path(bad_block))  # damaged whichever manifest lists it
        try:
            if judged is None:  # it could not be read whole (larger than a manifest may be)
                os.lstat(path)
                now = None
            else:
                now = read_bounded(path, mf.MAX_MANIFEST_BYTES, "a manifest")
        except FileNotFoundError:
            return  # removed meanwhile (evicted, then its blocks collected): nothing to say
        except NotAFile:
            return  # replaced by a FIFO, a directory...: not this layout's to delete
        except CorruptEntry:
            now = None  # grown past any manifest since: rewritten meanwhile
        except OSError:
            now = judged
        if judged is not None and now != judged:
            log.debug("cache entry %s was rewritten while it was read (%s); kept", path, reason)
            return
        self.dropped[key] = reason
        log.warning("cache entry %s dropped: %s%s", path, reason,
                    "" if unlink_quietly(path) else " (its manifest could not be deleted)")

    def _live_blocks(self) -> set[str]:
        """Ids of every block a manifest in the directory lists (``mf.listed_block_ids``),
        foreign identities and unknown block namings included. A file named like a
        manifest that lists none readably (not a regular file, unreadable) keeps none: one
        such file stopped every block from being collected, and the byte cap with it."""
        live: set[str] = set()
        seen: dict[str, tuple[int, frozenset[str]]] = {}
        for name in self._listdir(self.entries_dir):
            if not name.endswith(SUFFIX):
                continue
            raw = None
            try:
                # Read whole every time and reused only by its bytes' digest: what is deleted
                # here is chosen by it, and a file's version (inode, size, mtime) can repeat
                # for a rewrite (a freed inode reused within one timestamp tick). 11 us a
                # 10 KB manifest on the 2-core EPYC.
                raw = read_bounded(self.entries_dir / name, mf.MAX_MANIFEST_BYTES, "a manifest")
                digest = xxhash.xxh3_128_intdigest(raw)
                cached = self._parsed.get(name)
                if cached is None or cached[0] != digest:
                    cached = (digest, mf.listed_block_ids(raw))
                seen[name] = cached
                live.update(cached[1])
            except FileNotFoundError:
                continue
            except CorruptEntry as exc:
                self._drop(name[: -len(SUFFIX)], str(exc), raw)
            except (NotAFile, OSError) as exc:  # the scan reports it (ReportsSkipped)
                log.debug("block store %s: %s lists no block (%s)", self.directory, name, exc)
        self._parsed = seen
        return live

    def _reap_interrupted_writes(self) -> None:
        if not self.directory.is_dir() or not self._guard.allows():
            return  # nothing stored here: no lock file or folder made by looking
        try:
            with self._flock(exclusive=True, timeout=0):
                self._reap_tmp_files()
        except (_LockBusy, OSError):
            pass  # a write is in flight; the next scan or collect() reaps

    def _reap_tmp_files(self) -> int:
        """Under the exclusive lock no write is in flight, so every ``.tmp`` is an orphan."""
        freed = 0
        for folder in (self.entries_dir, self.data_dir):
            for name in self._listdir(folder):
                if name.endswith(".tmp"):
                    freed += blockfile.unlink_counting(folder / name)
        return freed

    @contextlib.contextmanager
    def _flock(self, *, exclusive: bool, timeout: float | None = None):
        """``flock`` on the directory's lock file; released by the kernel if we die.
        Each call opens its own descriptor, so threads of one process exclude each other.
        Without ``fcntl`` (Windows) writers go ahead and ``collect()`` never deletes."""
        try:
            import fcntl
        except ImportError:
            if exclusive:
                raise _LockBusy() from None
            yield
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
            if timeout is None:
                fcntl.flock(fd, mode)
            else:
                deadline = time.monotonic() + timeout
                while True:
                    try:
                        fcntl.flock(fd, mode | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise _LockBusy() from None
                        time.sleep(0.01)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def _indexed(self) -> list[_Indexed]:
        with self._lock:
            if self._index is not None:
                return list(self._index.values())
        self.scan()
        with self._lock:
            return list(self._index.values()) if self._index is not None else []

    def _forget(self, key: str) -> None:
        with self._lock:
            self._manifests.pop(key, None)
            self._scanned.pop(self.path(key).name, None)
            self._journal.record(key, None)
            if self._index is not None:
                self._index.pop(key, None)

    def _listdir(self, folder: Path) -> list[str]:
        try:
            return os.listdir(folder)
        except FileNotFoundError:
            return []
        except OSError as exc:
            self._io_failed(exc, f"list cache directory {folder}")
            return []

    def _io_failed(self, exc: OSError, action: str) -> None:
        self.io_failures += 1
        self._warned = log_io_failure(exc, action, warned=self._warned)


class _LockBusy(Exception):
    pass
