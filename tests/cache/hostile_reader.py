"""A fresh process that opens a storage layout over a directory an adversary prepared and
does what ``foretell run`` and ``foretell cache`` do with it (scan, read an entry, collect),
under an address-space limit, then prints what happened as one JSON line.

    python hostile_reader.py LAYOUT ROOT IDENTITY_JSON KEY

``LAYOUT`` is ``module:Class``. On Linux the limit (what the process holds once the layout
opened, plus :data:`HEADROOM`) turns a read of a huge or endless file into a MemoryError
and a non-zero exit instead of a machine driven out of memory; a hang is the caller's
timeout.
"""

from __future__ import annotations

import importlib
import json
import resource
import sys

#: What the process may allocate beyond what it holds once the layout is open.
HEADROOM = 2 << 30


def _virtual_bytes() -> int | None:
    """The process's address space (Linux); None where /proc does not say."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024  # bytes / KiB


def main(layout: str, root: str, identity_json: str, key: str) -> None:
    from foretell.store.entry import StoreIdentity

    module, _, name = layout.partition(":")
    factory = getattr(importlib.import_module(module), name)
    store = factory(root, None, identity=StoreIdentity(**json.loads(identity_json)))
    # The pools a read and a collect use start threads (stacks, malloc arenas): counted in.
    from foretell.store import format as fmt

    fmt.io_pool().submit(int).result()
    fmt.write_pool().submit(int).result()
    held = _virtual_bytes()
    if held is not None:  # elsewhere the peak below is the only guard
        resource.setrlimit(resource.RLIMIT_AS, (held + HEADROOM, held + HEADROOM))
    rss_before = _peak_rss_mb()
    scanned = [h.key for h in store.scan()]
    served = store.read(key) is not None
    store.collect()
    discover = getattr(factory, "stored_identities", None)
    if discover is not None:
        discover(root, sorted(store.identity.codec_providers))
    print(json.dumps({"scanned": scanned, "served": served, "skipped": store.skipped,
                      "rss_growth_mb": _peak_rss_mb() - rss_before}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
