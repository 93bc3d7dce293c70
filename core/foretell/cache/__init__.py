"""KV-cache state beyond one request: codecs that snapshot, restore and clone caches.

:mod:`foretell.cache.codecs` holds core's baseline codecs (``kv``, ``rotating-kv``) and the
helpers that apply them to a whole sequence of per-layer caches. Storage of the snapshots
lives in :mod:`foretell.store`.
"""
