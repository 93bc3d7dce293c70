"""Persistent storage of KV-cache entries (the SSD tier's layouts).

A storage layout (the :class:`~foretell.store.layout.StorageLayout` Protocol) writes an
:class:`~foretell.store.entry.Entry` atomically, reads it back verified, lists stored entries
from their headers, removes, garbage-collects and counts bytes; the cap is the tier's.
Core ships the ``single-file`` layout (:mod:`foretell.store.single_file`); plugins add
others through ``foretell_register_storage_layouts``. The file format is described in
docs/cache-storage.md. A layout that reads into MLX buffers of its own may keep a
:class:`~foretell.store.reserve.BufferReserve` (filled before restores need it) and say so
by :class:`~foretell.store.layout.KeepsRestoreReserve`: the tier then refills it off the
request path.
"""

from foretell.store.entry import (
    Entry,
    EntryHeader,
    LayerHeader,
    LayerState,
    StoreIdentity,
    config_fingerprint,
    files_digest,
    model_fingerprint,
    weights_digest,
)
from foretell.store.layout import (
    FindsPrefixes,
    KeepsRestoreReserve,
    LimitsCapacity,
    LocatesEntries,
    RecordsDeviceDigests,
    ReportsDropped,
    ReportsSkipped,
    StorageLayout,
    StoreError,
    url_scheme,
)
from foretell.store.reserve import BufferReserve

__all__ = ["BufferReserve", "Entry", "EntryHeader", "FindsPrefixes", "KeepsRestoreReserve",
           "LayerHeader", "LimitsCapacity", "LocatesEntries", "RecordsDeviceDigests",
           "ReportsDropped", "ReportsSkipped", "LayerState", "StorageLayout", "StoreError",
           "StoreIdentity", "config_fingerprint", "files_digest", "model_fingerprint",
           "url_scheme", "weights_digest"]
