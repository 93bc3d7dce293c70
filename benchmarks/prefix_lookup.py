"""What a RAM prefix cache lookup costs at a given number of entries, against a scan of
every entry (the lookup before the cache kept its entries sorted by tokens); with ``--ssd``,
the SSD tier's index lookup (``SsdIndex.find``, ``covers``) against its scan.

    python benchmarks/prefix_lookup.py [--ssd] [--entries 32,200,2000] [--repeats 200]
                                       [--json FILE]

Entries are what a server keeps of finished requests: a 128-token prompt and a 64-token
reply, one namespace, trimmable (a plain KV cache). Each lookup kind is timed on the same
cache both ways, and both ways must choose the same entry:

- ``new``: a fresh random prompt sharing nothing with any entry (``serve_load.py``'s
  prompts);
- ``system``: every entry and the prompt open with the same 32-token system prompt, so
  every entry ties at 32 tokens and the least recently used one serves (found first in the
  LRU order);
- ``sys-late``: as ``system``, but only the newer half of the entries open with the system
  prompt: the LRU order's first entries are not in the tie, and the whole tie is looked at
  (the sorted lookup's worst case);
- ``follow-up``: an entry's tokens and a new 40-token turn (one entry serves all of it);
- ``exact``: whether an entry holds a follow-up's tokens (``CacheTier.store``'s question);
- ``covers`` (``--ssd``, in place of ``exact``): whether a stored entry can restore a
  follow-up's tokens (``CacheTier.flush``'s question).

The lookups need no arrays, so entries hold none (stored ones are headers in memory, as a
layout's scan lists them, with no layers: trimmable from any offset). The SSD index breaks
ties by its order, the order the entries were stored in here, as the RAM cache by least
recent use. Printed: microseconds per lookup, median of ``--repeats``. Numbers only, never
assertions.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

from foretell.cache.prefix import PrefixCache, PrefixEntry, can_serve, match_rank, usable_length
from foretell.cache.ssd import SsdIndex, Stored
from foretell.store.entry import EntryHeader

PROMPT, REPLY, SYSTEM, TURN, VOCABULARY = 128, 64, 32, 40, 32_000


def linear_best(cache: PrefixCache, prompt: Sequence[int], namespace: str
                ) -> tuple[PrefixEntry | None, int]:
    """The lookup as it was: every entry, least recently used first."""
    best, length, rank = None, 0, match_rank(0, ())
    prompt = tuple(prompt)
    for entry in cache.entries():
        if entry.namespace != namespace:
            continue
        n = entry.usable(prompt)
        candidate = match_rank(n, entry.tokens, entry.attachment)
        if n > 0 and candidate > rank:
            best, length, rank = entry, n, candidate
    return best, length


def linear_exact(cache: PrefixCache, tokens: Sequence[int], namespace: str) -> bool:
    tokens = tuple(tokens)
    return any(e.namespace == namespace and e.tokens == tokens for e in cache.entries())


def linear_find(entries: Sequence[Stored], prompt: Sequence[int], namespace: str
                ) -> tuple[Stored | None, int]:
    """The SSD index's lookup as it was: every entry, in the index's order."""
    best, length, rank = None, 0, match_rank(0, ())
    prompt = tuple(prompt)
    for stored in entries:
        if stored.header.namespace != namespace:
            continue
        n = usable_length(prompt, stored.tokens, trimmable=stored.trimmable,
                          min_offset=stored.min_offset)
        candidate = match_rank(n, stored.tokens, stored.attachment)
        if n > 0 and candidate > rank:
            best, length, rank = stored, n, candidate
    return best, length


def linear_covers(entries: Sequence[Stored], tokens: Sequence[int], namespace: str) -> bool:
    return any(s.header.namespace == namespace and can_serve(
        s.tokens, trimmable=s.trimmable, min_offset=s.min_offset, old_tokens=tokens)
        for s in entries)


class HeldLayout:
    """Stored headers in memory: what :class:`SsdIndex` asks of a layout to look up."""

    def __init__(self) -> None:
        self.held: list[EntryHeader] = []

    def add(self, tokens: tuple[int, ...]) -> None:
        self.held.append(EntryHeader(key=str(len(self.held)), tokens=tokens, layers=(),
                                     namespace="", nbytes=1, last_used=len(self.held)))

    def scan(self) -> list[EntryHeader]:
        return list(self.held)

    def collect(self) -> int:
        return 0

    def bytes(self) -> int:
        return len(self.held)


def conversation(rng: random.Random, opening: tuple[int, ...]) -> tuple[int, ...]:
    return opening + tuple(rng.randrange(VOCABULARY) for _ in range(PROMPT + REPLY - len(opening)))


def filled(count: int, rng: random.Random, opening: tuple[int, ...],
           cache: PrefixCache | None = None) -> PrefixCache:
    cache = cache if cache is not None else PrefixCache([], max_bytes=1 << 62)
    for _ in range(count):
        cache.hold(PrefixEntry(tokens=conversation(rng, opening), namespace="", caches=[],
                               nbytes=1, trimmable=True, min_offset=0))
    return cache


def stored(count: int, rng: random.Random, opening: tuple[int, ...],
           index: SsdIndex | None = None) -> SsdIndex:
    index = index if index is not None else SsdIndex(HeldLayout(), [], max_bytes=1 << 62)
    for _ in range(count):
        index.layout.add(conversation(rng, opening))
    index.scan()
    return index


def micros(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(count: int, repeats: int, seed: int, ssd: bool = False
            ) -> dict[str, dict[str, float]]:
    rng = random.Random(seed)
    fill = stored if ssd else filled
    system = tuple(rng.randrange(VOCABULARY) for _ in range(SYSTEM))
    plain, shared = fill(count, rng, ()), fill(count, rng, system)
    late = fill(count - count // 2, rng, system, fill(count // 2, rng, ()))
    held = rng.choice(plain.entries()).tokens
    follow_up = held + tuple(rng.randrange(VOCABULARY) for _ in range(TURN))
    # A token no entry holds, where the prompts part from the entries: no chance match.
    fresh = (VOCABULARY, *(rng.randrange(VOCABULARY) for _ in range(PROMPT - SYSTEM - 1)))
    prompts = {
        "new": (plain, fresh + tuple(rng.randrange(VOCABULARY) for _ in range(SYSTEM))),
        "system": (shared, system + fresh),
        "sys-late": (late, system + fresh),
        "follow-up": (plain, follow_up),
    }
    row = {}
    for kind, (cache, prompt) in prompts.items():
        if ssd:  # entries() lists them in the index's order: each last used as stored
            lookup, scan = (partial(cache.find, prompt, ""),
                            partial(linear_find, cache.entries(), prompt, ""))
        else:
            lookup, scan = partial(cache.best, prompt, ""), partial(linear_best, cache, prompt, "")
        entry, length = lookup()
        if (entry, length) != scan():
            raise SystemExit(f"{kind} at {count} entries: the lookups disagree")
        row[kind] = {"sorted_us": micros(lookup, repeats), "scan_us": micros(scan, repeats),
                     "served": length}
    if ssd:
        entries = plain.entries()
        if plain.covers(follow_up, "") != linear_covers(entries, follow_up, ""):
            raise SystemExit(f"covers at {count} entries: the lookups disagree")
        row["covers"] = {"sorted_us": micros(lambda: plain.covers(follow_up, ""), repeats),
                         "scan_us": micros(lambda: linear_covers(entries, follow_up, ""),
                                           repeats),
                         "served": 0}
        return row
    # exact() marks what it finds as used: asked of a missing tuple, nothing changes.
    row["exact"] = {"sorted_us": micros(lambda: plain.exact(follow_up, ""), repeats),
                    "scan_us": micros(lambda: linear_exact(plain, follow_up, ""), repeats),
                    "served": 0}
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ssd", action="store_true",
                        help="the SSD tier's index instead of the RAM cache")
    parser.add_argument("--entries", help="sizes to time (default 32,200,2000; with --ssd "
                        "200,2000,10000)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    report = {}
    print(f"{'entries':>8} {'lookup':>10} {'sorted us':>10} {'scan us':>10} {'served':>7}")
    sizes = args.entries or ("200,2000,10000" if args.ssd else "32,200,2000")
    for count in (int(c) for c in sizes.split(",")):
        report[count] = measure(count, args.repeats, args.seed, args.ssd)
        for kind, row in report[count].items():
            print(f"{count:>8} {kind:>10} {row['sorted_us']:>10.1f} {row['scan_us']:>10.1f} "
                  f"{row['served']:>7}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
