"""How far processes sharing one cache directory take it over its byte cap.

    python scripts/shared_dir_cap.py [PROCESSES] [CAP_MB] [RESCAN_S]   # default 3 4 0

Starts PROCESSES writers over one fresh directory (block store, a synthetic identity), each
storing 60 entries of 512 tokens x 4 layers of random KV (262 KB each, none sharing a block)
through its own cache tier with the cap, flushing after each and resting 0.1 s; after each
write it sums the bytes of every file under the directory. Prints each writer's largest sum
and its last one as multiples of the cap. RESCAN_S is the tier's floor on how old its view
of the directory must be before a write re-reads it (0: as often as re-reads stay within
``foretell.cache.ssd.RESCAN_SHARE`` of the time; 30: the rule before 2026-12-05). Numbers
only, never assertions (docs/cache-storage.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

ENTRIES, TOKENS, LAYERS, HEADS, DIM = 60, 512, 4, 2, 8


def directory_bytes(root: str) -> int:
    total = 0
    for folder, _dirs, names in os.walk(root):
        for name in names:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except OSError:
                pass  # removed while we looked
    return total


def writer(root: str, who: int, cap: int, rescan_s: float) -> None:
    import mlx.core as mx

    from foretell.cache.codecs import StandardKVCodec
    from foretell.cache.tier import CacheTier
    from foretell.model import KVCache
    from foretell.store.entry import StoreIdentity
    from foretell_blockstore.layout import BlockStoreLayout

    codecs = [StandardKVCodec()]
    identity = StoreIdentity(model_fingerprint="0123456789abcdef", model_id="shared-dir-cap",
                             tokenizer_hash="none",
                             codec_providers=[c.provider_id for c in codecs])
    tier = CacheTier(codecs, layout=BlockStoreLayout(root, identity=identity), ssd_bytes=cap)
    tier.ssd.rescan_s = rescan_s

    def cache(seed: int) -> KVCache:
        keys, values = mx.random.normal((2, 1, HEADS, TOKENS, DIM), key=mx.random.key(seed))
        kv = KVCache()
        kv.update_and_fetch(keys, values)
        return kv

    peak = 0
    for i in range(ENTRIES):
        start = 100_000 * who + 1_000 * i
        tier.store(range(start, start + TOKENS), [cache(start + j) for j in range(LAYERS)])
        tier.flush(30)
        peak = max(peak, directory_bytes(root))
        time.sleep(0.1)
    print(f"writer {who}: largest {peak / cap:.2f}x the cap, last {directory_bytes(root) / cap:.2f}x")


def main() -> None:
    if sys.argv[1:2] == ["--writer"]:
        root, who, cap, rescan_s = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
        writer(root, who, cap, rescan_s)
        return
    processes = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    cap = int(float(sys.argv[2]) * 1e6) if len(sys.argv) > 2 else 4_000_000
    rescan_s = sys.argv[3] if len(sys.argv) > 3 else "0"
    with tempfile.TemporaryDirectory(prefix="foretell-shared-cap-") as root:
        runs = [subprocess.Popen([sys.executable, __file__, "--writer", root, str(who),
                                  str(cap), rescan_s]) for who in range(processes)]
        for run in runs:
            run.wait()


if __name__ == "__main__":
    main()
