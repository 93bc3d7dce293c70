"""Decode beside a spill writer that never runs dry, its blocks named by SHA-256 (the block
store before 2026-12-03) and by XXH3-128 (now), against idle decoding (not a test).

    python scripts/writer_ab.py [ROUNDS] [--prompt-tokens 4096] [--generate 64]

The demo model's KV for the prompt is the entry; each writing row keeps the spill worker
rewriting it into an empty directory (``foretell bench --cache``'s "decode tok/s idle /
writing" column, ``_write_until``) while 64 tokens decode. Rows take turns, order flipping
each round; the paired median is each round's ratio to its idle run (``take_turns.py``;
$OUT/writer-ab.json). Numbers only
(docs/cache-storage.md, "Writes run at low CPU priority").
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
from pathlib import Path

from take_turns import take_turns

import foretell

ROWS = ("idle", "sha256", "xxh3-128")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", nargs="?", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--generate", type=int, default=64)
    args = ap.parse_args()
    engine = foretell.load("demo")
    from foretell.cache import bench as cache_bench
    from foretell.cache.codecs import snapshot_entry
    from foretell.cache.tier import CacheTier
    from foretell.tools.bench import prompt_ids
    from foretell_blockstore import manifest

    work = Path(tempfile.mkdtemp(prefix="foretell-writer-ab-"))
    prompt = prompt_ids(Path(engine.path), args.prompt_tokens)
    tier = CacheTier.for_engine(engine, work / "cache", layout="blocks")
    engine.cache = tier
    list(engine.generate(prompt, max_tokens=1, ignore_eos=True))
    donor = max(tier.ram.entries(), key=lambda e: len(e.tokens))
    entry = snapshot_entry(donor.tokens, donor.caches, tier.codecs)
    store = tier.ssd.layout
    engine.cache = None

    def factory(root: Path):
        return type(store)(root, store.config, identity=store.identity)

    short = list(donor.tokens[:32])

    writes: dict[str, list[int]] = {row: [] for row in ROWS if row != "idle"}

    def decode(row: str, _seed: int) -> float:
        if row == "idle":
            return cache_bench._generate(engine, short, args.generate).generation_tps
        manifest.BLOCK_NAMING = row
        stop, count = threading.Event(), [0]
        writer = threading.Thread(target=cache_bench._write_until,
                                  args=(factory, work / "scratch", entry, stop, count), daemon=True)
        writer.start()
        try:
            return cache_bench._generate(engine, short, args.generate).generation_tps
        finally:
            stop.set()
            writer.join()
            writes[row].append(count[0])

    take_turns(ROWS, decode, args.rounds, "idle", "writer-ab.json")
    print(f"entry {entry.tensor_bytes / 1e6:.1f} MB; writes per decode (median, after the "
          f"warm-up): " + ", ".join(f"{row} {statistics.median(found[1:])}"
                                   for row, found in writes.items()))

if __name__ == "__main__":
    main()
