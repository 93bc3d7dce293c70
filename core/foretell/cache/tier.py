"""The cache tier: the one object the engine asks for a prompt's prefix and hands states to.

    tier = CacheTier.open("~/.cache/foretell", model_dir, codecs=codecs)
    engine = Engine(model, tokenizer, cache=tier)   # engines of one model may share a tier

RAM first (:mod:`foretell.cache.prefix`), then the persistent tier's index
(:mod:`foretell.cache.ssd`, over any storage layout: a directory, or a URL a plugin's layout
serves), which wins only with a strictly longer usable prefix; a restored entry is promoted
into RAM. Every stored state goes to RAM at once and to the layout through the spill queue
(:mod:`foretell.cache.spill`, write-behind on a worker thread). ``flush`` is the durability
coordinator: it waits for the queue, rewrites from RAM what was dropped or failed, and says
"durable" only when every stored state is stored. Storage trouble never stops generation.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx

from foretell.cache.codecs import CacheCodec, restore_caches, snapshot_entry
from foretell.cache.prefix import PrefixCache, match_rank
from foretell.cache.spill import CLOSE_TIMEOUT_S, FlushReport, SpillQueue
from foretell.cache.ssd import SsdIndex
from foretell.errors import ConfigError
from foretell.model.kvcache import trim_all
from foretell.store import digest
from foretell.store.entry import Entry, LayerForm, StoreIdentity, forms_differ, layer_form
from foretell.store.layout import (
    KeepsRestoreReserve,
    RecordsDeviceDigests,
    StorageLayout,
    url_scheme,
)

log = logging.getLogger("foretell.cache")

GiB = 1 << 30
DEFAULT_RAM_BYTES = 4 * GiB
DEFAULT_SSD_BYTES = 32 * GiB
DEFAULT_SPILL_BYTES = 2 * GiB

Key = tuple[str, tuple[int, ...]]


@attrs.frozen
class Reuse:
    """What a lookup found: caches holding the first ``tokens`` prompt tokens, and where
    they came from (``"ram"``, ``"ssd"``; ``None`` and no caches on a miss)."""

    caches: list[Any] | None
    tokens: int
    tier: str | None


class CacheTier:
    """RAM prefix cache + optional SSD tier with write-behind and truthful durability."""

    def __init__(
        self,
        codecs: Sequence[CacheCodec],
        *,
        ram_bytes: int = DEFAULT_RAM_BYTES,
        layout: StorageLayout | None = None,
        ssd_bytes: int = DEFAULT_SSD_BYTES,
        spill_bytes: int = DEFAULT_SPILL_BYTES,
        spill_duty: float | None = None,
        checkpoint_every: int = 64,
        identity: StoreIdentity | None = None,
        structure: Sequence[LayerForm] | None = None,
    ):
        self.codecs = list(codecs)
        #: The model whose states this tier holds (its layout's identity, or the one
        #: :meth:`for_engine` gave a RAM-only tier): an engine of another model refuses it
        #: (:meth:`mismatch`). None: unchecked (a tier an integrator built by hand).
        self.identity = identity if identity is not None or layout is None else layout.identity
        #: The form of the model's cache layers (:func:`engine_structure`): a restored entry
        #: of another form is deleted, never served, and an engine whose caches differ is
        #: refused. None: unchecked (a tier built by hand).
        self.structure = tuple(structure) if structure is not None else None
        #: Resumable generations are checkpointed every this many generated tokens.
        self.checkpoint_every = checkpoint_every
        self.ram = PrefixCache(self.codecs, ram_bytes)
        self.ssd = (SsdIndex(layout, self.codecs, ssd_bytes, structure=self.structure)
                    if layout is not None else None)
        #: Whether entries handed to the writer get device digests (the layout records them).
        # The Protocol's check sees the attribute, not its value: a layout may say False.
        self._digests = (isinstance(layout, RecordsDeviceDigests)
                         and layout.records_device_digests is True)
        # spill_duty: the share of its time the writer may write (None: spill.default_duty)
        self._spill = (SpillQueue(self._write, spill_bytes, self._written, spill_duty)
                       if self.ssd is not None else None)
        self._lock = threading.Lock()
        #: States handed to ``store`` and not yet known to be stored by the layout.
        self._dirty: set[Key] = set()
        self._failed = 0
        #: Checkpoints of completed generations still queued: deleted as they land.
        self._finished: set[Key] = set()
        self.ssd_hits = 0
        self._closed = False
        if self.ssd is not None:
            self.ssd.scan()
            self.replenish()  # start-up pays the restore reserve's fill, not a first restore
            _close_open_tiers_at_exit(self)

    @classmethod
    def open(
        cls,
        cache_dir: str | Path,
        model_dir: str | Path,
        *,
        codecs: Sequence[CacheCodec],
        model_id: str | None = None,
        kv_scheme: str = "plain",
        layout: Callable[..., StorageLayout] | None = None,
        layout_config: Any = None,
        identity: StoreIdentity | None = None,
        **caps: Any,
    ) -> CacheTier:
        """A tier over ``cache_dir`` for the model in ``model_dir`` (its fingerprint, of
        config and weights, and its tokenizer hash name whose entries are served; or
        ``identity``, computed already). ``cache_dir`` is a directory, or a URL
        (``redis://host:6379/0``) that the layout registered for its scheme stores at.
        ``layout`` is a layout class (:meth:`for_engine` passes the configured default;
        without one, the single-file layout core ships for a directory, the installed
        plugins' layout for a URL); ``caps``: ``ram_bytes``, ``ssd_bytes``, ``spill_bytes``
        (and the tier's other keywords: ``structure``...).

        :raises ConfigError: ``cache_dir`` names a file (a missing directory is made on
            first write; an unwritable one warns and generation goes on).
        :raises UnknownContribution: a URL no installed layout stores at."""
        from foretell.store.single_file import SingleFileLayout

        if not str(cache_dir).strip():  # Path("") is the current directory: not what was meant
            raise ConfigError("cache_dir", ["is empty: give a directory, or None for no "
                                             "persistent cache"])
        if url_scheme(cache_dir) is not None:
            root: str | Path = str(cache_dir).strip()
            if layout is None:
                from foretell.plugin.loader import load_plugins

                layout = load_plugins().registry.layout_for(root).load()
        else:
            root = Path(cache_dir).expanduser()
            if root.exists() and not root.is_dir():  # as the CLI's --cache-dir refuses it
                raise ConfigError("cache_dir", [f"{cache_dir} is a file, not a directory"])
        if identity is None:
            model_dir = Path(model_dir)
            identity = StoreIdentity.for_model_dir(
                model_dir, model_id=model_id or model_dir.name, kv_scheme=kv_scheme,
                codec_providers=[c.provider_id for c in codecs])
        factory = layout or SingleFileLayout
        store = factory(root, layout_config, identity=identity)
        return cls(codecs, layout=store, **caps)

    @classmethod
    def for_engine(cls, engine: Any, cache_dir: str | Path | None = None, **options: Any
                   ) -> CacheTier:
        """A tier for ``engine``'s model and KV scheme, with every codec its plugins
        registered; RAM only when ``cache_dir`` is None. Attach it with ``engine.cache =``.
        ``layout``: a layout class or a registered layout's name (default: ``[cache]
        layout``'s; for a URL, the layout registered for its scheme), with
        ``layout_config`` (default: the layout's defaults).

        :raises ConfigError: ``layout`` names a layout that does not store at the URL
            ``cache_dir``."""
        from foretell.cache.codecs import load_codecs
        from foretell.config import DEFAULT_LAYOUT
        from foretell.plugin.loader import load_plugins
        from foretell.plugin.registry import Kind

        registry = engine.registry if engine.registry is not None else load_plugins().registry
        codecs = load_codecs(registry)
        options.setdefault("structure", engine_structure(engine, codecs))
        if cache_dir is None:
            options.pop("layout", None)
            options.pop("layout_config", None)
            options.pop("ssd_bytes", None)
            return cls(codecs, identity=engine_identity(engine, codecs), **options)
        layout = options.get("layout", DEFAULT_LAYOUT)
        serving = registry.layout_for(cache_dir) if isinstance(layout, str) else None
        if serving is not None:
            # A URL decides its layout; the default name only means none was chosen.
            if layout not in (DEFAULT_LAYOUT, serving.name):
                raise ConfigError("layout", [f"'{layout}' does not store at {cache_dir}: "
                                             f"layout '{serving.name}' does"])
            layout = options["layout"] = serving.name
        if isinstance(layout, str):
            contribution = registry.get(Kind.LAYOUT, layout)
            options["layout"] = contribution.load()
            if options.get("layout_config") is None and contribution.config is not None:
                options["layout_config"] = contribution.config()
        # The engine's identity, kept with it: assigning the tier compares the same one.
        return cls.open(cache_dir, engine.path, codecs=codecs,
                        identity=engine_identity(engine, codecs), **options)

    @classmethod
    def from_section(cls, engine: Any, section: Any) -> CacheTier:
        """A tier for ``engine`` as a ``[cache]`` section (:class:`foretell.config.CacheSection`)
        describes it; the storage layout is looked up by name among the plugins'."""
        return cls.for_engine(
            engine, section.dir, ram_bytes=int(section.ram_gb * GiB),
            ssd_bytes=int(section.max_gb * GiB), checkpoint_every=section.checkpoint_every,
            layout=section.layout, layout_config=section.layout_options)

    def mismatch(self, engine: Any) -> str | None:
        """Why ``engine`` must not use this tier (its states belong to another model,
        tokenizer or KV scheme), or None. Engines of one model may share a tier."""
        if self.identity is None:
            return None
        theirs = engine_identity(engine, self.codecs)
        if theirs is None:
            return None
        for field in ("model_fingerprint", "tokenizer_hash", "kv_scheme"):
            ours, other = getattr(self.identity, field), getattr(theirs, field)
            if ours != other:
                return (f"this cache tier holds states of {self.identity.model_id} "
                        f"({field} {ours}); the engine runs {theirs.model_id} ({field} {other})")
        form = engine_structure(engine, self.codecs) if self.structure is not None else None
        if form is not None and form != self.structure:  # e.g. another compute precision
            why = forms_differ(self.structure, form) or (
                f"{len(self.structure)} layers, the model has {len(form)}")
            return f"this cache tier's states are not of the engine's form: {why}"
        return None

    # -- lookup -----------------------------------------------------------------------------

    def lookup(self, prompt: Sequence[int], namespace: str = "", prefer: str | None = None
               ) -> Reuse:
        """Caches (fresh clones, trimmed to the match) holding the longest usable prefix of
        ``prompt``; the SSD tier is read only when it serves strictly better than RAM.
        ``prefer``: a drafter identity whose exact-boundary state beats a longer trimmed
        prefix (:func:`~foretell.cache.prefix.match_rank`)."""
        entry, length = self.ram.best(prompt, namespace, prefer)
        ram_rank = match_rank(length, entry.tokens if entry is not None else (),
                              entry.attachment if entry is not None else None, prefer)
        while self.ssd is not None:
            stored, disk_length = self.ssd.find(prompt, namespace, prefer, beyond=length)
            if stored is None or match_rank(disk_length, stored.tokens, stored.attachment,
                                            prefer) <= ram_rank:
                break
            restored = self.ssd.read(stored)
            if restored is None:
                continue  # damaged: the layout deleted it and the index dropped it; next best
            try:
                caches = restore_caches(restored, self.codecs)
            except Exception as exc:  # noqa: BLE001 - a codec plugin's defect: not served
                self.ssd.warn_once("codec load", f"cache entry of {len(restored.tokens)} tokens "
                                   f"could not be rebuilt ({type(exc).__name__}: {exc}); "
                                   "not served")
                self.ssd.forget(stored.header.key)  # kept on disk: its bytes verified
                continue
            self.ssd_hits += 1
            promoted = self.ram.adopt(restored.tokens, caches, namespace)
            if promoted is not None:
                return Reuse(self.ram.take(promoted, disk_length), disk_length, "ssd")
            trim_all(caches, len(restored.tokens) - disk_length)
            return Reuse(caches, disk_length, "ssd")
        if entry is None:
            self.ram.misses += 1
            return Reuse(None, 0, None)
        self.ram.hits += 1
        if self.ssd is not None:
            self.ssd.touch(entry.tokens, namespace)
        return Reuse(self.ram.take(entry, length), length, "ram")

    def replenish(self) -> None:
        """Refill the layout's restore reserve (:class:`~foretell.store.layout.
        KeepsRestoreReserve`) if a restore used it: where MLX runs and no request waits (the
        tier's opening; each request's end, ``RequestCache.finish``). Synchronous: it fills
        at most the largest stored entry's bytes (docs/block-store.md, "The restore
        reserve")."""
        if self.ssd is not None and isinstance(self.ssd.layout, KeepsRestoreReserve):
            self.ssd.layout.replenish()

    # -- storing ----------------------------------------------------------------------------

    def store(self, tokens: Sequence[int], caches: Sequence[Any], namespace: str = "") -> None:
        """Keep the state of ``caches`` after ``tokens`` in RAM now and stored soon (the
        caller keeps using its caches: everything held is a zero-copy clone).

        :raises CodecError: a cache has no codec (nothing is stored then).
        """
        tokens = tuple(tokens)
        # The same tokens give the same state: a repeat (a RAM hit that computed only the
        # last prompt token) is already held, and rewriting it would only cost write time.
        held = self.ram.exact(tokens, namespace)
        on_disk = self.ssd is not None and self.ssd.find_exact(tokens, namespace) is not None
        if held and (self.ssd is None or on_disk or self._is_dirty(namespace, tokens)):
            return
        if not held and not self.ram.put(tokens, caches, namespace):
            log.debug("cache entry of %d tokens is larger than the RAM cap", len(tokens))
        if self._spill is None or on_disk:
            return
        self.persist(snapshot_entry(tokens, caches, self.codecs, namespace))

    def _is_dirty(self, namespace: str, tokens: tuple[int, ...]) -> bool:
        with self._lock:
            return (namespace, tokens) in self._dirty

    def persist(self, entry: Entry) -> None:
        """Queue ``entry`` for the SSD tier (no RAM copy): generation checkpoints. An entry
        larger than the SSD cap is not queued (it could never be stored, and that is the
        cap's doing, not a failure): one warning, and ``flush`` does not wait for it."""
        if self._spill is None:
            return
        if not self.ssd.fits(entry.tensor_bytes):
            return
        entry = self.for_writer(entry)
        with self._lock:
            key = (entry.namespace, entry.tokens)
            self._dirty.add(key)
            # Stored anew (the same request run again): wanted, whatever a completed run
            # left marked for deletion under the same key (a mark whose write was dropped
            # or failed is never cleared by a landing).
            self._finished.discard(key)
        self._spill.submit(entry)

    def for_writer(self, entry: Entry) -> Entry:
        """``entry`` as this tier hands it to its writer (call where MLX runs, on the thread
        that computed it), so the spill worker only reads memory and never runs an MLX op:
        slices are evaluated views, a strided bfloat16 view (numpy cannot read it without
        an MLX op) is made contiguous, and where the layout records them the tensors'
        device digests are computed (foretell.store.digest)."""
        layers = []
        for layer in entry.layers:
            tensors = {name: mx.contiguous(t) if t.dtype == mx.bfloat16 else t
                       for name, t in layer.tensors.items()}
            layers.append(attrs.evolve(layer, tensors=tensors))
        mx.eval([t for layer in layers for t in layer.tensors.values()])
        ready = attrs.evolve(entry, layers=layers)
        return digest.attach(ready) if self._digests else ready

    def _write(self, entry: Entry) -> bool:
        return self.ssd.write(entry)

    def _written(self, entry: Entry, outcome: str) -> None:
        key = (entry.namespace, entry.tokens)
        with self._lock:
            if outcome == "stored":
                self._dirty.discard(key)
            elif outcome == "failed":
                self._failed += 1
            finished = key in self._finished
            self._finished.discard(key)
        if outcome == "stored" and self.ssd is not None:
            if finished:
                self.ssd.remove(self.ssd.layout.key_for(entry.tokens, entry.namespace))
            elif entry.namespace.startswith(CHECKPOINT_PREFIX):
                self._supersede_checkpoints(entry)

    # -- generation checkpoints ---------------------------------------------------------------

    def checkpoints(self, namespace: str) -> list[Any]:
        """Stored checkpoints of one generation, oldest first (index only)."""
        return [] if self.ssd is None else self.ssd.in_namespace(namespace)

    def read(self, stored: Any) -> Entry | None:
        return None if self.ssd is None else self.ssd.read(stored)

    def discard(self, namespace: str) -> None:
        """The generation of ``namespace`` completed: delete its checkpoints, now and those
        still queued as they land. Only those: the same request run again (the same prompt
        and settings, so the same namespace) checkpoints anew."""
        with self._lock:
            self._finished |= {k for k in self._dirty if k[0] == namespace}
            self._dirty = {k for k in self._dirty if k[0] != namespace}
        for stored in self.checkpoints(namespace):
            self.ssd.remove(stored.header.key)

    def _supersede_checkpoints(self, entry: Entry) -> None:
        # Only after the newer one is stored: a crash before that keeps the prior point.
        for stored in self.ssd.in_namespace(entry.namespace):
            if len(stored.tokens) < len(entry.tokens):
                self.ssd.remove(stored.header.key)

    # -- durability ---------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> FlushReport:
        """Wait (up to ``timeout`` seconds) until the layout holds every stored state.

        Dropped or failed writes are retried from RAM; a state that is neither in RAM nor
        covered by the layout is ``missing``. ``durable`` only when nothing is left.
        """
        if self._spill is None:
            return FlushReport(durable=False, pending=0, dropped=0, failed=0, missing=0)
        deadline = None if timeout is None else time.monotonic() + timeout
        drained = self._spill.drain(timeout)
        missing = 0
        for namespace, tokens in self._dirty_keys() if drained else []:
            if deadline is not None and time.monotonic() >= deadline:
                break
            donor = next((e for e in self.ram.entries()
                          if e.namespace == namespace and e.tokens == tokens), None)
            # A state with a drafter's attachment is covered only by itself, stored.
            if self.ssd.covers(tokens, namespace, attached=donor is not None and donor.attached):
                self._clean((namespace, tokens))
                continue
            if donor is None:  # dropped, then evicted from RAM: reported once, then let go
                missing += 1
                self._clean((namespace, tokens))
                continue
            entry = self.for_writer(snapshot_entry(tokens, donor.caches, self.codecs, namespace))
            if self.ssd.write(entry):
                self._clean((namespace, tokens))
        with self._lock:
            left = len(self._dirty)
            failed = self._failed
            self._failed = 0
        pending = self._spill.pending()
        dropped = self._spill.take_dropped()
        return FlushReport(durable=drained and left == missing == pending == 0,
                           pending=pending, dropped=dropped, failed=failed, missing=missing)

    def close(self, timeout: float | None = None) -> FlushReport:
        """Flush (bounded) and stop the spill worker; then, if this tier wrote and all of it
        is durable, re-read the store and evict to the cap over everything in it, so
        processes that wrote there at once leave it within the cap as they exit (each
        indexed only what it found when it opened, docs/cache-storage.md)."""
        report = self.flush(timeout)
        self._closed = True
        if self._spill is not None:
            self._spill.close(0)
        if self.ssd is not None and self.ssd.writes and report.durable:
            self.ssd.scan()
        return report

    def _dirty_keys(self) -> list[Key]:
        with self._lock:
            return list(self._dirty)

    def _clean(self, key: Key) -> None:
        with self._lock:
            self._dirty.discard(key)

    # -- reporting ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        ram = {"entries": len(self.ram), "bytes": self.ram.bytes(), "max_bytes": self.ram.max_bytes,
               "hits": self.ram.hits, "misses": self.ram.misses, "evictions": self.ram.evictions}
        out: dict[str, Any] = {"ram": ram}
        if self.ssd is not None:
            out["ssd"] = {
                "entries": len(self.ssd.entries()), "bytes": self.ssd.bytes(),
                "max_bytes": self.ssd.cap(), "hits": self.ssd_hits,
                "restores": self.ssd.restores, "restore_failures": self.ssd.restore_failures,
                "writes": self.ssd.writes, "evictions": self.ssd.evictions,
                "io_failures": self.ssd.layout.io_failures, "pending": self._spill.pending(),
            }
        return out


def engine_identity(engine: Any, codecs: Sequence[CacheCodec]) -> StoreIdentity | None:
    """The identity of ``engine``'s model and KV scheme as a tier over its directory would
    have it (None for an engine built without a model directory). Computed once per engine
    and scheme (it hashes the tokenizer and samples the weights): opening a tier for an
    engine and assigning it both ask."""
    from foretell.cache.quantized import kv_scheme

    if engine.path is None:
        return None
    scheme = kv_scheme(engine.kv_bits, engine.kv_group_size)
    providers = tuple(sorted(c.provider_id for c in codecs))
    known = _ENGINE_IDENTITIES.setdefault(engine, {})
    if (scheme, providers) not in known:
        known[(scheme, providers)] = StoreIdentity.for_model_dir(
            engine.path, model_id=Path(engine.path).name, codec_providers=providers,
            kv_scheme=scheme)
    return known[(scheme, providers)]


_ENGINE_IDENTITIES: weakref.WeakKeyDictionary[Any, dict[tuple, StoreIdentity]] = (
    weakref.WeakKeyDictionary())


def engine_structure(engine: Any, codecs: Sequence[CacheCodec]
                     ) -> tuple[LayerForm, ...] | None:
    """The form of each of ``engine``'s cache layers in its KV scheme: what the first
    layers of an entry restored for it must hold (``foretell.store.entry.form_mismatch``).
    Read from one token fed to fresh caches, built and never evaluated (MLX knows a lazy
    array's shape and dtype without computing it). None where the model cannot be probed
    so, or a cache has no codec (then restores go unchecked). Once per engine and scheme."""
    from foretell.cache.codecs import codec_for
    from foretell.cache.quantized import kv_scheme

    scheme = kv_scheme(engine.kv_bits, engine.kv_group_size)
    known = _ENGINE_STRUCTURES.setdefault(engine, {})
    if scheme not in known:
        try:
            caches = engine.make_caches()
            engine.model.forward(mx.array([[0]]), caches)
            known[scheme] = tuple(layer_form(codec_for(cache, codecs).snapshot(cache)[0])
                                  for cache in caches)
        except Exception as exc:  # noqa: BLE001 - a model that cannot be probed: unchecked
            log.debug("cache layers of %s not probed (%s: %s); restores unchecked",
                      engine.path, type(exc).__name__, exc)
            known[scheme] = None
    return known[scheme]


_ENGINE_STRUCTURES: weakref.WeakKeyDictionary[Any, dict[str, Any]] = (
    weakref.WeakKeyDictionary())


#: Tiers with an SSD tier not yet closed (weakly: a tier let go needs no closing).
_OPEN_TIERS: weakref.WeakSet[CacheTier] = weakref.WeakSet()
_EXIT_LOCK = threading.Lock()
_EXIT_HOOKED: list[bool] = []


def _close_open_tiers_at_exit(tier: CacheTier) -> None:
    """Have :func:`_close_at_exit` close ``tier`` as the interpreter exits. The hook runs
    among threading's exit calls, before the thread pools the writes use refuse work (an
    ``atexit`` hook comes after them: "cannot schedule new futures after interpreter
    shutdown"); those calls run last registered first, so the pools' module is imported
    before the hook registers."""
    import concurrent.futures.thread  # noqa: F401 - its own exit call must run after ours

    with _EXIT_LOCK:
        if not _EXIT_HOOKED:
            threading._register_atexit(_close_at_exit)  # type: ignore[attr-defined]
            # A forked child has the parent's tiers but not their writer thread: closing
            # them would wait out the bound for a queue no thread drains. The parent's.
            os.register_at_fork(after_in_child=_OPEN_TIERS.clear)
            _EXIT_HOOKED.append(True)
        _OPEN_TIERS.add(tier)


def _close_at_exit() -> None:
    """Close every tier still open as the interpreter exits, so a script that generates
    and returns keeps what it computed: the writer is a daemon thread, and without this its
    queued writes died with the process (an integrator's script lost every entry of its
    last requests). Bounded by :data:`~foretell.cache.spill.CLOSE_TIMEOUT_S`; what is not durable by then is said
    once."""
    for tier in list(_OPEN_TIERS):
        if tier._closed:
            continue
        try:
            report = tier.close(CLOSE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - exiting: say it, never raise from here
            log.warning("cache tier could not be flushed at exit (%s: %s)",
                        type(exc).__name__, exc)
            continue
        if not report.durable:
            log.warning("the cache is not durable at exit (%s)", report.shortfall())


#: Namespaces of in-flight generation checkpoints start with this; they never seed prompts.
CHECKPOINT_PREFIX = "generation:"
