"""What a RAM prefix cache lookup costs at a given number of entries, against a scan of
every entry (the lookup before the cache kept its entries sorted by tokens).

    python benchmarks/prefix_lookup.py [--entries 32,200,2000] [--repeats 200] [--json FILE]

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
- ``exact``: whether an entry holds a follow-up's tokens (``CacheTier.store``'s question).

The lookups need no arrays, so entries hold none. Printed: microseconds per lookup, median
of ``--repeats``. Numbers only, never assertions.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence

from foretell.cache.prefix import PrefixCache, PrefixEntry, match_rank

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


def filled(count: int, rng: random.Random, opening: tuple[int, ...],
           cache: PrefixCache | None = None) -> PrefixCache:
    cache = cache if cache is not None else PrefixCache([], max_bytes=1 << 62)
    for _ in range(count):
        tokens = opening + tuple(rng.randrange(VOCABULARY)
                                 for _ in range(PROMPT + REPLY - len(opening)))
        cache.hold(PrefixEntry(tokens=tokens, namespace="", caches=[], nbytes=1,
                               trimmable=True, min_offset=0))
    return cache


def micros(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(count: int, repeats: int, seed: int) -> dict[str, dict[str, float]]:
    rng = random.Random(seed)
    system = tuple(rng.randrange(VOCABULARY) for _ in range(SYSTEM))
    plain, shared = filled(count, rng, ()), filled(count, rng, system)
    late = filled(count - count // 2, rng, system, filled(count // 2, rng, ()))
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
        entry, length = cache.best(prompt, "")
        if (entry, length) != linear_best(cache, prompt, ""):
            raise SystemExit(f"{kind} at {count} entries: the lookups disagree")
        row[kind] = {
            "sorted_us": micros(lambda c=cache, p=prompt: c.best(p, ""), repeats),
            "scan_us": micros(lambda c=cache, p=prompt: linear_best(c, p, ""), repeats),
            "served": length}
    # exact() marks what it finds as used: asked of a missing tuple, nothing changes.
    row["exact"] = {"sorted_us": micros(lambda: plain.exact(follow_up, ""), repeats),
                    "scan_us": micros(lambda: linear_exact(plain, follow_up, ""), repeats),
                    "served": 0}
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", default="32,200,2000")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    report = {}
    print(f"{'entries':>8} {'lookup':>10} {'sorted us':>10} {'scan us':>10} {'served':>7}")
    for count in (int(c) for c in args.entries.split(",")):
        report[count] = measure(count, args.repeats, args.seed)
        for kind, row in report[count].items():
            print(f"{count:>8} {kind:>10} {row['sorted_us']:>10.1f} {row['scan_us']:>10.1f} "
                  f"{row['served']:>7}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
