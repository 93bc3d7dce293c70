"""The ``redis`` storage layout: the block store's entries kept in Redis or Valkey.

An entry is cut into blocks exactly as the block store cuts it (``foretell_blockstore.
manifest``): every layer of a token range in one block, named by the XXH3-128 of its bytes,
listed by a manifest. Under ``<prefix>:<model fingerprint>-<kv scheme>:<STORE>`` (the
identity's ``base``)::

    base:b:<block id>   a block, byte for byte the block store's block file; written once
                        (SET NX), shared by every entry and every process that holds its rows
    base:m:<entry key>  a manifest (the block store's: identity, tokens, codec meta, blocks)
    base:entries        sorted set: published entry -> last use
    base:digests        hash: published entry -> its manifest's XXH3-64 (scans fetch only
                        manifests that changed)
    base:loose          sorted set: block -> when it was last written or left unlisted
    base:p:<chain>      leading-blocks pointer: the entry whose first k blocks of tokens
                        hash, chained, to <chain> (XXH3-128 of the identity and k*B tokens)
    <prefix>:identities hash: every identity stored on the server (``foretell cache``)

Rules kept (DESIGN.md §4): an entry is published by one script (:mod:`foretell_redis.
scripts`) that first checks every block is stored, so no manifest ever lists a missing
block and a writer killed at any point leaves nothing listed half-written (8); every read
checks the manifest's hash and identity and every block's size, header and checksum before
an array is returned, and drops what fails (7, 8); the server unreachable, restarted or
full warns once per outage and never raises: the cache serves from RAM and computes the
rest, and tries the server again after ``retry_s`` (9); ``bytes()`` counts each block once
and ``capacity()`` keeps the tier's byte cap under the server's ``maxmemory`` (10).

A hit costs two round trips: the lookup (:data:`scripts.LOOKUP`: the longest pointer of the
prompt's chained block hashes and its manifest) and the read (the manifest and every block
in one pipeline). ``collect`` frees blocks no manifest lists: those marked loose (by a
removal, or by a writer that never published) past ``collect_grace_s``, and, when the store
lists no entry, every unlisted block found by a sweep.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import xxhash

from foretell.store import format as fmt
from foretell.store import reserve as rsv
from foretell.store.entry import Entry, EntryHeader, LayerState, StoreIdentity, entry_key
from foretell.store.layout import (
    CorruptEntry,
    ForeignEntry,
    ScanJournal,
    StoreError,
    UnknownVersion,
    url_scheme,
)
from foretell_blockstore import manifest as mf
from foretell_blockstore.blockfile import BadBlock
from foretell_redis import SCHEMES, scripts
from foretell_redis.client import connect, server_failure, server_full, without_credentials
from foretell_redis.config import RedisConfig
from foretell_redis.reading import assemble

log = logging.getLogger("foretell.store")

#: entry_key's format version for this layout (keys never collide with another format's).
KEY_VERSION = 103
#: In every key: another block format's entries are never seen, so never served or collected.
STORE = "r1-" + mf.FORMAT_VERSION.replace("/", "")
#: Bytes of blocks one pipeline uploads (bounds the joined copies a write holds at once).
UPLOAD_BYTES = 64 << 20
#: Manifests one MGET fetches.
FETCH_MANIFESTS = 256
#: Times a write stores blocks that vanished before its publication (collected or evicted).
PUBLISH_TRIES = 3
#: The longest wait between tries of a server that failed.
RETRY_MAX_S = 30.0


@attrs.frozen
class _Indexed:
    header: EntryHeader
    manifest_bytes: int
    blocks: tuple[mf.BlockRef, ...]
    #: What a read of it takes from the restore reserve (mf.buffer_bytes).
    buffer_bytes: int = 0


class RedisLayout:
    """One model's entries on one Redis or Valkey server; safe to share between threads,
    processes and machines. Conforms to :class:`foretell.store.layout.StorageLayout`, finds
    the entries other processes stored (``FindsPrefixes``), keeps the tier under the
    server's ``maxmemory`` (``LimitsCapacity``), keeps a restore reserve
    (``KeepsRestoreReserve``), names entries by URL (``LocatesEntries``) and says what it
    skipped and dropped (``ReportsSkipped``, ``ReportsDropped``)."""

    records_device_digests = False

    def __init__(self, root: str | Path, config: RedisConfig | None = None, *,
                 identity: StoreIdentity):
        self.config = config if config is not None else RedisConfig()
        self.identity = identity
        self.url = str(root).strip()
        #: The URL without credentials: what messages and ``location`` name.
        self.where = without_credentials(self.url)
        self._client = connect(self.url, self.config)
        self._base = f"{self.config.key_prefix}:{identity.directory}:{STORE}"
        self._identities = f"{self.config.key_prefix}:identities"
        self._scripts = {name: self._client.register_script(getattr(scripts, name))
                         for name in ("TOUCH", "PUBLISH", "REMOVE", "LOOKUP", "COLLECT")}
        self._lock = threading.Lock()
        self._index: dict[str, _Indexed] | None = None
        self._journal = ScanJournal()
        #: key -> (manifest bytes, their digest, what they parsed to): reads and scans reuse it.
        self._manifests: dict[str, tuple[bytes, str, mf.Manifest]] = {}
        #: key -> (manifest digest, block ids) of every listed manifest, foreign ones too:
        #: what collect() keeps.
        self._listed: dict[str, tuple[str, frozenset[str]]] = {}
        #: key -> why a listed manifest is passed over (another identity's, another version).
        self._passed_over: dict[str, str] = {}
        self._capacity: int | None = None
        self._sweep = False
        #: Outage bookkeeping: warned once per outage; no request until ``_retry_at``.
        self._warned = False
        self._failures = 0
        self._retry_at = 0.0
        #: Warned that the server is full (refusing writes): until a write succeeds.
        self._warned_full = False
        # Parsed now, so a bad FORETELL_RESTORE_RESERVE_MB fails as the store opens.
        self._reserve_cap = rsv.env_cap()
        #: Buffers filled before a restore needs them (replenish); None until the first.
        self.reserve: rsv.BufferReserve | None = None
        #: Failed requests since this layout opened (unreachable, full, read-only server).
        self.io_failures = 0
        #: Entry location -> why it is passed over (another model's, another version).
        self.skipped: dict[str, str] = {}
        #: Entry key -> why it was dropped as damaged, since the last scan began.
        self.dropped: dict[str, str] = {}
        #: Block bytes this layout uploaded / found stored already (the benchmark reads them).
        self.bytes_written = 0
        self.bytes_reused = 0
        self._load_scripts()

    @classmethod
    def stored_identities(cls, root: str | Path, codec_providers: Sequence[str]
                          ) -> list[StoreIdentity]:
        """Every identity with entries stored on the server ``root`` names (``foretell cache``
        without ``--model`` acts on each); none for a location that is not such a URL.

        :raises StoreError: the server cannot be reached."""
        if url_scheme(str(root)) not in SCHEMES:
            return []
        config = RedisConfig()
        client = connect(str(root), config)
        try:
            fields = client.hkeys(f"{config.key_prefix}:identities")
        except Exception as exc:
            raise StoreError(f"{without_credentials(str(root))}: cannot list stored models "
                             f"({type(exc).__name__}: {exc})") from None
        found = []
        for field in fields:
            try:
                fingerprint, scheme, model_id, tokenizer_hash = json.loads(field)
                found.append(StoreIdentity(
                    model_fingerprint=fingerprint, kv_scheme=scheme, model_id=model_id,
                    tokenizer_hash=tokenizer_hash, codec_providers=codec_providers))
            except (ValueError, TypeError):
                continue
        return found

    def _load_scripts(self) -> None:
        """Load the scripts now, in one round trip, so that no request pays for loading one
        (a script the server lost by restarting is loaded again where it is next used)."""
        try:
            pipe = self._client.pipeline(transaction=False)
            for script in self._scripts.values():
                pipe.script_load(script.script)
            pipe.execute()
        except Exception as exc:  # noqa: BLE001 - the server's failure, whatever it was
            if not server_failure(exc):
                raise
            self._failed(exc, "load its scripts")

    # -- keys ---------------------------------------------------------------------------

    def key_for(self, tokens: Sequence[int], namespace: str = "") -> str:
        return entry_key(self.identity, namespace, tokens, KEY_VERSION)

    def location(self, key: str) -> str:
        """The server and the entry's manifest key (``LocatesEntries``)."""
        return f"{self.where}#{self._manifest_key(key)}"

    def _manifest_key(self, key: str) -> str:
        return f"{self._base}:m:{key}"

    def _block_key(self, block_id: str) -> str:
        return f"{self._base}:b:{block_id}"

    def _pointers(self, tokens: Sequence[int], namespace: str, first: int, last: int
                  ) -> list[str]:
        """The pointer keys of the prefixes of ``first`` to ``last`` blocks of ``tokens``,
        longest first: the chained hash of the identity, the block size and the tokens."""
        rows = self.config.block_tokens
        seed = json.dumps([STORE, self.identity.model_fingerprint, self.identity.kv_scheme,
                           self.identity.model_id, self.identity.tokenizer_hash, namespace,
                           rows])
        chain = xxhash.xxh3_128(seed.encode())
        keys = []
        for k in range(1, last + 1):
            chain.update(array("q", tokens[(k - 1) * rows:k * rows]).tobytes())
            if k >= first:
                keys.append(f"{self._base}:p:{chain.hexdigest()}")
        return keys[::-1]

    def _entry_pointers(self, tokens: Sequence[int], namespace: str) -> list[str]:
        return self._pointers(tokens, namespace, 1, len(tokens) // self.config.block_tokens)

    # -- the layout contract -------------------------------------------------------------

    def write(self, entry: Entry) -> bool:
        """Store ``entry``: its blocks the server lacks, then its manifest, published by one
        script only once every block it lists is there. True once the server acknowledged
        the publication (surviving a restart of the server is its persistence's to say:
        ``appendonly``); a failure warns once per outage and returns False."""
        if self._resting():
            return False
        key = self.key_for(entry.tokens, entry.namespace)
        rows = self.config.block_tokens
        hosts = mf.host_views(entry)
        listed, made = [], {}
        for group in mf.plan_groups(entry):
            refs = []
            for begin, end in group.spans(rows):
                pieces = mf.block_pieces(hosts, group, begin, end)
                header = mf.block_header(group, begin, end)
                ref = mf.block_ref(header, pieces)
                made.setdefault(ref.id, (header, pieces))
                refs.append(ref)
            listed.append((group, refs))
        raw = mf.render(entry, self.identity, rows, time.time(), listed)
        blocks = [ref for _group, refs in listed for ref in refs]
        pointers = self._entry_pointers(entry.tokens, entry.namespace)
        last_used = time.time()
        try:
            missing = self._decode(self._scripts["TOUCH"](
                keys=[f"{self._base}:loose", *(self._block_key(i) for i in made)],
                args=list(made)))
            self._upload(missing, made)
            self.bytes_reused += sum(r.nbytes for r in {r.id: r for r in blocks}.values()
                                     if r.id not in missing)
            for _attempt in range(PUBLISH_TRIES):
                missing = self._decode(self._scripts["PUBLISH"](
                    keys=[self._manifest_key(key), f"{self._base}:entries",
                          f"{self._base}:digests", f"{self._base}:loose", self._identities,
                          *pointers, *(self._block_key(r.id) for r in blocks)],
                    args=[raw, key, len(pointers), repr(last_used), _digest(raw),
                          self._identity_field(), *(r.id for r in blocks)]))
                if not missing:
                    break
                self._upload(missing, made)
            else:
                log.warning("cache entry %s not stored: its blocks were deleted as fast as "
                            "they were written (another process collecting?)",
                            self.location(key))
                self.io_failures += 1
                return False
        except Exception as exc:  # noqa: BLE001 - the server's failure, whatever it was
            if not server_failure(exc):
                raise
            self._failed(exc, f"store cache entry {key}")
            return False
        self._answered()
        self._warned_full = False
        manifest = mf.parse(raw)
        indexed = self._indexed_entry(key, raw, manifest, last_used)
        with self._lock:
            self._manifests[key] = (raw, _digest(raw), manifest)
            self._listed[key] = (_digest(raw), frozenset(r.id for r in blocks))
            if self._index is not None:
                self._index[key] = indexed
            self._journal.record(key, indexed)
        return True

    def _upload(self, ids: Sequence[str], made: dict[str, tuple[bytes, list]]) -> None:
        """Store the blocks ``ids`` (SET NX: a block of the same name holds the same bytes),
        pipelined in batches of about :data:`UPLOAD_BYTES`."""
        pipe, pending = self._client.pipeline(transaction=False), 0
        for block_id in ids:
            header, pieces = made[block_id]
            value = b"".join([header, *(run for runs in pieces for run in runs)])
            pipe.set(self._block_key(block_id), value, nx=True)
            pending += len(value)
            self.bytes_written += len(value)
            if pending >= UPLOAD_BYTES:
                pipe.execute()
                pipe, pending = self._client.pipeline(transaction=False), 0
        if len(pipe):
            pipe.execute()

    def read(self, key: str) -> Entry | None:
        """The entry under ``key`` assembled from its blocks, each verified: its manifest and
        (where this process knows that manifest) its blocks in one round trip. None when
        absent, foreign, of another version, damaged (then dropped with one warning) or
        when the server cannot be reached."""
        try:
            raw, manifest, layers = self._fetch(key, mark_used=True)
        except _Absent:
            self._forget(key)
            return None
        except BadBlock as bad:
            self._drop(key, bad.reason, bad.judged, bad_block=bad.block_id)
            return None
        except _Damaged as damaged:
            self._drop(key, damaged.reason, damaged.judged)
            return None
        except _Skipped as skipped:
            log.debug("cache entry %s skipped: %s", self.location(key), skipped.reason)
            self.skipped[self.location(key)] = skipped.reason
            self._forget(key)
            return None
        except _Unreachable:
            return None
        with self._lock:
            if self._index is not None and key in self._index:
                found = self._index[key]
                self._index[key] = attrs.evolve(found, header=attrs.evolve(
                    found.header, last_used=time.time()))
                self._journal.record(key, self._index[key], if_present=True)
        return Entry(tokens=manifest.tokens, layers=layers, namespace=manifest.namespace)

    def read_layers(self, key: str, *, verify: bool = True) -> list[LayerState]:
        """The entry's tensors read as :meth:`read` reads them, dropping nothing and marking
        nothing used (``foretell cache verify``); ``verify=False`` skips the blocks'
        checksums (the benchmark's unverified row).

        :raises CorruptEntry: the manifest or a block is damaged, or the entry is absent.
        :raises StoreError: the server cannot be reached.
        """
        try:
            return self._fetch(key, mark_used=False, verify=verify)[2]
        except (BadBlock, _Damaged) as exc:
            raise CorruptEntry(exc.reason) from None
        except _Absent:
            raise CorruptEntry("no such entry") from None
        except _Skipped as exc:
            raise StoreError(exc.reason) from None
        except _Unreachable as exc:
            raise StoreError(f"{self.where} cannot be reached ({exc})") from None

    def _fetch(self, key: str, *, mark_used: bool, verify: bool = True
               ) -> tuple[bytes, mf.Manifest, list[LayerState]]:
        """The manifest and the tensors of ``key``, every check passed.

        :raises _Absent, _Skipped, _Damaged, BadBlock, _Unreachable: as the names say."""
        if self._resting():
            raise _Unreachable("resting after a failure")
        known = self._manifests.get(key)
        pipe = self._client.pipeline(transaction=False)
        pipe.get(self._manifest_key(key))
        if known is not None:
            pipe.mget([self._block_key(r.id) for r in known[2].blocks])
        if mark_used:
            pipe.zadd(f"{self._base}:entries", {key: time.time()}, xx=True)
        try:
            # Marking it used is a write, which a full server refuses: the read still serves.
            replies = pipe.execute(raise_on_error=False)
            failed = next((r for r in replies[:2 if known is not None else 1]
                           if isinstance(r, Exception)), None)
            if failed is not None:
                raise failed
            raw = replies[0]
            if raw is None:
                raise _Absent()
            if known is not None and known[0] == raw:
                manifest, values = known[2], replies[1]
            else:
                manifest = self._checked_manifest(key, raw)
                values = self._client.mget([self._block_key(r.id) for r in manifest.blocks])
        except (_Absent, _Skipped, _Damaged):
            raise
        except Exception as exc:  # noqa: BLE001 - the server's failure, whatever it was
            if not server_failure(exc):
                raise
            self._failed(exc, f"read cache entry {key}")
            raise _Unreachable(str(exc)) from None
        self._answered()
        try:
            layers = assemble(manifest, values, verify=verify, reserve=self.reserve)
        except BadBlock as bad:
            bad.judged = raw
            raise
        return raw, manifest, layers

    def _checked_manifest(self, key: str, raw: bytes) -> mf.Manifest:
        """``raw`` parsed and checked (its hash, identity, and key against its tokens), and
        kept for later reads.

        :raises _Damaged: it is not a sound manifest, or answers for another prompt.
        :raises _Skipped: another identity's, another version's."""
        try:
            manifest = mf.parse(raw)
            fmt.check_identity(manifest.fields, self.identity)
            if self.key_for(manifest.tokens, manifest.namespace) != key:
                raise CorruptEntry("its key does not match the tokens it holds")
        except CorruptEntry as exc:
            raise _Damaged(str(exc), raw) from None
        except (UnknownVersion, ForeignEntry) as exc:
            raise _Skipped(str(exc)) from None
        with self._lock:
            self._manifests[key] = (raw, _digest(raw), manifest)
        return manifest

    def prefixes(self, prompt: Sequence[int], namespace: str, beyond: int
                 ) -> list[EntryHeader]:
        """The stored entry whose leading blocks match the most of ``prompt`` past ``beyond``
        tokens, found in one round trip: the pointers of the prompt's chained block hashes,
        longest first, and the manifest the first set one names (``FindsPrefixes``)."""
        rows = self.config.block_tokens
        first, last = max(1, beyond // rows), (len(prompt) - 1) // rows
        if last < first or self._resting():
            return []
        try:
            found = self._scripts["LOOKUP"](
                keys=self._pointers(prompt, namespace, first, last),
                args=[f"{self._base}:m:"])
        except Exception as exc:  # noqa: BLE001 - the server's failure, whatever it was
            if not server_failure(exc):
                raise
            self._failed(exc, "look up stored prefixes")
            return []
        self._answered()
        if not found:
            return []
        key, raw = found[0].decode(), found[1]
        try:
            manifest = self._checked_manifest(key, raw)
        except _Damaged as damaged:
            self._drop(key, damaged.reason, raw)
            return []
        except _Skipped as skipped:
            self.skipped[self.location(key)] = skipped.reason
            return []
        indexed = self._indexed_entry(key, raw, manifest, time.time())
        with self._lock:
            self._listed[key] = (_digest(raw), frozenset(r.id for r in manifest.blocks))
            if self._index is not None and key not in self._index:
                self._index[key] = indexed
                self._journal.record(key, indexed)
        return [indexed.header]

    def scan(self) -> list[EntryHeader]:
        """Rebuild the index from what the server lists (no block bytes are read): fetch
        only the manifests that changed since the last scan, drop entries whose manifest is
        damaged or whose blocks are gone, skip other identities' and versions'. Least
        recently used first. With the server unreachable: what was indexed before."""
        with self._lock:
            changes = self._journal.begin()
            self.dropped = {}
        try:
            found, skipped = self._scan_server()
        except _Unreachable:
            with self._lock:
                self._journal.finish(changes, {})
                if self._index is None:
                    self._index = {}
                return sorted((i.header for i in self._index.values()),
                              key=lambda h: h.last_used)
        with self._lock:
            self._index = found = self._journal.finish(changes, found)
            self.skipped = skipped
            return sorted((i.header for i in found.values()), key=lambda h: h.last_used)

    def _scan_server(self) -> tuple[dict[str, _Indexed], dict[str, str]]:
        """The entries listed on the server, checked, and the ones passed over (by their
        location, why).

        :raises _Unreachable: the server failed (said once)."""
        used, fetched = self._refresh_listed(parsed=True)
        try:
            present = self._blocks_present({k: raw for k, raw in fetched.items() if raw})
        except Exception as exc:  # noqa: BLE001 - the server's failure, whatever it was
            if not server_failure(exc):
                raise
            self._failed(exc, "list cache entries")
            raise _Unreachable(str(exc)) from None
        found, skipped = {}, {}
        for key, last_used in used.items():
            raw = fetched.get(key)
            if raw is None and key in fetched:
                continue  # unlisted by _refresh_listed: its manifest is gone
            if raw is None:
                if key in self._passed_over:
                    skipped[self.location(key)] = self._passed_over[key]
                known = self._manifests.get(key)
                if known is not None:
                    found[key] = self._indexed_entry(key, known[0], known[2], last_used)
                continue
            try:
                manifest = self._checked_manifest(key, raw)
            except _Damaged as damaged:
                self._drop(key, damaged.reason, raw)
                continue
            except _Skipped as why:
                self._passed_over[key] = why.reason
                skipped[self.location(key)] = why.reason
                continue
            if not present.get(key, True):
                self._drop(key, "a block it lists is gone (evicted by the server?)", raw)
                continue
            found[key] = self._indexed_entry(key, raw, manifest, last_used)
        with self._lock:
            self._manifests = {k: v for k, v in self._manifests.items() if k in found}
            self._passed_over = {k: v for k, v in self._passed_over.items() if k in used}
        return found, skipped

    def _refresh_listed(self, *, parsed: bool = False
                        ) -> tuple[dict[str, float], dict[str, bytes | None]]:
        """What the server lists (entry key -> last use), and the manifests that changed
        since this process last saw them (fetched; None where one is gone, then unlisted),
        with ``parsed`` also those this process has not judged yet (a scan's). Brings
        ``_listed`` (every listed manifest's blocks, what collect keeps) up to date and
        reads the server's ``maxmemory``.

        :raises _Unreachable: the server failed (said once)."""
        if self._resting():
            raise _Unreachable("resting after a failure")
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.zrange(f"{self._base}:entries", 0, -1, withscores=True)
            pipe.hgetall(f"{self._base}:digests")
            pipe.info("memory")
            listing, digests, memory = pipe.execute()
            used = {k.decode(): score for k, score in listing}
            digests = {k.decode(): v.decode() for k, v in digests.items()}
            limit = int(memory.get("maxmemory", 0) or 0)
            self._capacity = int(limit * self.config.memory_share) if limit else None
            stale = [k for k in used if k not in self._listed
                     or self._listed[k][0] != digests.get(k)
                     or (parsed and k not in self._manifests and k not in self._passed_over)]
            fetched: dict[str, bytes | None] = {}
            for start in range(0, len(stale), FETCH_MANIFESTS):
                batch = stale[start:start + FETCH_MANIFESTS]
                fetched.update(zip(batch, self._client.mget(
                    [self._manifest_key(k) for k in batch])))
        except Exception as exc:  # noqa: BLE001 - the server's failure, whatever it was
            if not server_failure(exc):
                raise
            self._failed(exc, "list cache entries")
            raise _Unreachable(str(exc)) from None
        self._answered()
        listed = {k: v for k, v in self._listed.items() if k in used}
        for key, raw in fetched.items():
            if raw is None:  # listed, its manifest gone (evicted by the server): unlisted
                self._unlist(key)
                listed.pop(key, None)
                continue
            try:
                listed[key] = (_digest(raw), mf.listed_block_ids(raw))
            except StoreError:
                listed[key] = (_digest(raw), frozenset())
        with self._lock:
            self._listed = listed
        return used, fetched

    def _blocks_present(self, manifests: dict[str, bytes]) -> dict[str, bool]:
        """Whether every block each new manifest lists is stored (one pipeline)."""
        asked, pipe = [], self._client.pipeline(transaction=False)
        for key, raw in manifests.items():
            try:
                ids = sorted({r.id for r in mf.parse(raw).blocks})
            except StoreError:
                continue  # judged by the caller
            if ids:
                asked.append((key, len(ids)))
                pipe.exists(*(self._block_key(i) for i in ids))
        return {key: int(n) == want for (key, want), n in zip(asked, pipe.execute())}

    def headers(self) -> list[EntryHeader]:
        """The index, least recently used first (scans once if it was never built)."""
        return sorted((i.header for i in self._indexed()), key=lambda h: h.last_used)

    def __iter__(self) -> Iterator[EntryHeader]:
        return iter(self.headers())

    def __len__(self) -> int:
        return len(self._indexed())

    def remove(self, key: str) -> bool:
        """Unpublish the entry: its manifest and the pointers that name it; its blocks go at a
        later ``collect()`` unless another entry lists them."""
        if self._resting():
            return False
        try:
            deleted = self._unpublish(key, judged=b"")
        except Exception as exc:  # noqa: BLE001 - the server's failure, whatever it was
            if not server_failure(exc):
                raise
            self._failed(exc, f"delete cache entry {key}")
            return False
        self._answered()
        self._forget(key)
        return deleted == 1

    def _unpublish(self, key: str, judged: bytes) -> int:
        """Run the removal script for ``key``, with its pointers and block ids as far as the
        manifest can be known (fetched when this process has not seen it)."""
        known = self._manifests.get(key)
        if known is not None:
            manifest = known[2]
        else:
            raw = judged or self._client.get(self._manifest_key(key))
            try:
                manifest = mf.parse(raw) if raw else None
            except StoreError:
                manifest = None
        pointers = (self._entry_pointers(manifest.tokens, manifest.namespace)
                    if manifest is not None else [])
        ids = sorted({r.id for r in manifest.blocks}) if manifest is not None else []
        return int(self._scripts["REMOVE"](
            keys=[self._manifest_key(key), f"{self._base}:entries", f"{self._base}:digests",
                  f"{self._base}:loose", *pointers],
            args=[key, judged, *ids]))

    def collect(self) -> int:
        """Delete blocks no listed manifest (of any identity sharing this base) lists: those
        marked loose more than ``collect_grace_s`` ago, and when nothing is listed (the
        store was cleared) or entries were found gone, every unlisted block a sweep finds;
        returns bytes freed. Never deletes a block a listed manifest names."""
        if self._resting():
            return 0
        try:
            self._refresh_listed()
            live = set().union(*(ids for _digest, ids in self._listed.values()))
            candidates = {m.decode() for m in self._client.zrange(
                f"{self._base}:loose", 0, -1)} - live
            if self._sweep or not self._listed:
                candidates |= set(self._swept()) - live
            freed = 0
            ordered = sorted(candidates)
            for start in range(0, len(ordered), 512):
                batch = ordered[start:start + 512]
                freed += int(self._scripts["COLLECT"](
                    keys=[f"{self._base}:loose", *(self._block_key(i) for i in batch)],
                    args=[repr(self.config.collect_grace_s), *batch]))
            if live:  # listed blocks need no loose mark: a removal marks them again
                self._client.zrem(f"{self._base}:loose", *live)
            if not self._listed:
                self._client.hdel(self._identities, self._identity_field())
            self._sweep = False
        except _Unreachable:
            return 0
        except Exception as exc:  # noqa: BLE001 - the server's failure, whatever it was
            if not server_failure(exc):
                raise
            self._failed(exc, "delete unused blocks")
            return 0
        self._answered()
        return freed

    def _swept(self) -> Iterator[str]:
        """Every block id stored under this base (a SCAN of the server's keys: only when
        collect has reason to look beyond the loose marks)."""
        head = len(self._block_key(""))
        for name in self._client.scan_iter(match=self._block_key("*"), count=1000):
            yield name.decode()[head:]

    def bytes(self) -> int:
        """Bytes of the entries this layout serves: manifests plus each block they use once."""
        indexed = self._indexed()
        unique = {ref.id: ref.nbytes for i in indexed for ref in i.blocks}
        return sum(i.manifest_bytes for i in indexed) + sum(unique.values())

    def replenish(self) -> None:
        """Fill the restore reserve up to the largest indexed entry's buffers (within its
        cap: ``FORETELL_RESTORE_RESERVE_MB``, else the block store's CPU default), the first
        time and after a restore took from it (``KeepsRestoreReserve``: the tier calls it
        where MLX runs and no request waits). A restore then copies its blocks into filled
        memory instead of zeroing fresh buffers first."""
        indexed = self._indexed()
        with self._lock:
            if self.reserve is None:
                cap = self._reserve_cap if self._reserve_cap is not None else (
                    rsv.default_cap(False))
                if cap == 0:
                    return
                self.reserve = rsv.BufferReserve(cap)
        if self.reserve.used_since_fill():
            self.reserve.refill(max((i.buffer_bytes for i in indexed), default=0))

    def capacity(self) -> int | None:
        """``memory_share`` of the server's ``maxmemory`` as of the last scan; None when it
        sets none (``LimitsCapacity``)."""
        return self._capacity

    # -- internals -------------------------------------------------------------------------

    def _identity_field(self) -> str:
        i = self.identity
        return json.dumps([i.model_fingerprint, i.kv_scheme, i.model_id, i.tokenizer_hash])

    def _indexed_entry(self, key: str, raw: bytes, manifest: mf.Manifest, last_used: float
                       ) -> _Indexed:
        return _Indexed(
            header=EntryHeader(key=key, tokens=manifest.tokens, namespace=manifest.namespace,
                               layers=manifest.layers,
                               nbytes=len(raw) + manifest.tensor_bytes, last_used=last_used),
            manifest_bytes=len(raw), blocks=tuple(manifest.blocks),
            buffer_bytes=mf.buffer_bytes(group for group, _refs in manifest.groups))

    def _drop(self, key: str, reason: str, judged: bytes | None, *,
              bad_block: str | None = None) -> None:
        """Never serve this entry again: unpublish it if its manifest is still the one that
        was ``judged`` (another process may have rewritten it meanwhile), and delete a
        damaged block, which later writes of the same bytes would otherwise reuse."""
        self._forget(key)
        try:
            if bad_block is not None and "missing" not in reason:
                self._client.delete(self._block_key(bad_block))
            outcome = self._unpublish(key, judged=judged or b"")
        except Exception as exc:  # noqa: BLE001 - the server's failure, whatever it was
            if not server_failure(exc):
                raise
            self._failed(exc, f"delete damaged cache entry {key}")
            return
        if outcome == -1:
            log.debug("cache entry %s was rewritten while it was read (%s); kept",
                      self.location(key), reason)
            return
        self.dropped[key] = reason
        log.warning("cache entry %s dropped: %s", self.location(key), reason)

    def _unlist(self, key: str) -> None:
        """A listed entry whose manifest is gone: unlist it, and sweep for its blocks."""
        self._forget(key)
        self._sweep = True
        try:
            self._unpublish(key, judged=b"")
        except Exception as exc:  # noqa: BLE001 - the server's failure, whatever it was
            if not server_failure(exc):
                raise
            self._failed(exc, f"unlist cache entry {key}")

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
            self._listed.pop(key, None)
            self._journal.record(key, None)
            if self._index is not None:
                self._index.pop(key, None)

    @staticmethod
    def _decode(ids: list[bytes]) -> list[str]:
        return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]

    def _resting(self) -> bool:
        """After a failure the server is left alone until ``_retry_at``: a request to a host
        that does not answer costs its timeout, which requests must not wait out each time."""
        return time.monotonic() < self._retry_at

    def _failed(self, exc: BaseException, action: str) -> None:
        """One failed request: counted; a warning at the first of an outage (or of the
        server refusing writes, full), debug after. An unreachable server is then left
        alone for ``retry_s``, doubling while it stays so; a full one still serves reads."""
        with self._lock:
            self.io_failures += 1
            if server_full(exc):
                first, self._warned_full = not self._warned_full, True
            else:
                first, self._warned = not self._warned, True
                self._failures += 1
                wait = min(self.config.retry_s * 2 ** (self._failures - 1), RETRY_MAX_S)
                self._retry_at = time.monotonic() + wait
        if first and server_full(exc):
            log.warning(
                "cache store %s is full and refuses writes (%s); new prefixes are kept in "
                "RAM only until it has room (raise its maxmemory, or lower [cache] max_gb "
                "or memory_share so foretell evicts first)", self.where, exc)
        elif first:
            log.warning(
                "cache store %s: cannot %s (%s: %s); the cache serves from RAM and "
                "computes the rest, and tries the server again in %.0f s. Further failures "
                "are logged at debug level until it answers.", self.where, action,
                type(exc).__name__, exc, self.config.retry_s)
        else:
            log.debug("cache store %s: cannot %s (%s)", self.where, action, exc)

    def _answered(self) -> None:
        if self._warned or self._failures:
            with self._lock:
                was, self._warned, self._failures = self._warned, False, 0
            if was:
                log.info("cache store %s answers again", self.where)


def _digest(raw: bytes) -> str:
    return f"{xxhash.xxh3_64_intdigest(raw):016x}"


class _Absent(Exception):
    pass


class _Unreachable(Exception):
    pass


class _Damaged(Exception):
    def __init__(self, reason: str, judged: bytes | None):
        super().__init__(reason)
        self.reason = reason
        self.judged = judged


class _Skipped(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason
