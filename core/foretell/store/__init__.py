"""Persistent storage of KV-cache entries (the SSD tier's layouts).

A storage layout writes an :class:`~foretell.store.entry.Entry` atomically, reads it back
verified, lists stored entries from their headers, and keeps their bytes under a cap.
Core ships the ``single-file`` layout (:mod:`foretell.store.single_file`); plugins add
others through ``foretell_register_storage_layouts``. The file format is described in
docs/cache-storage.md.
"""

from foretell.store.entry import (
    Entry,
    EntryHeader,
    LayerHeader,
    LayerState,
    StoreIdentity,
    config_fingerprint,
)

__all__ = ["Entry", "EntryHeader", "LayerHeader", "LayerState", "StoreIdentity",
           "config_fingerprint"]
