"""What a cache hit's first write costs: ``python scripts/first_write_probe.py [TOKENS]``.

A hit's caches share the RAM entry's buffers, so their first write copies the history into
a buffer of their own (value semantics). Prints, on the demo model's KV shape:

1. the first writes into views of 12 float32 tensors (6 layers of K and V, 4 heads of 64),
   six times in this process (the first into fresh memory);
2. RAM hits of a TOKENS-token prompt (default 4,096) on the demo model, each forward timed:
   a hit's first one-token forward copies, the next ones at the same context do not;
3. the same hits taking turns with a prototype that lands the copy in pre-touched arrays of
   its own (independent MLX arrays donated to the write): its TTFT beside the plain one.

Numbers only, never assertions (docs/cache-storage.md, "Not done").
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from foretell.platform import blas

blas.preload()  # before mlx is imported (docs/blas.md)

import mlx.core as mx  # noqa: E402

import foretell  # noqa: E402
from foretell.cache.tier import CacheTier  # noqa: E402
from foretell.model import kvcache  # noqa: E402

SLACK = 512


def bare_first_writes(tokens: int) -> list[float]:
    donors = [mx.random.normal((1, 4, tokens, 64)) for _ in range(12)]
    mx.eval(donors)
    spent = []
    for _ in range(6):
        start = time.perf_counter()
        clones = [donor[:, :, :tokens, :] for donor in donors]  # views, as a hit's clones
        for clone in clones:
            clone[..., tokens - 1:tokens, :] = mx.ones((1, 4, 1, 64))
        mx.eval(clones)
        spent.append(time.perf_counter() - start)
        del clones
    return spent


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    print("bare first writes, ms:", [round(s * 1e3, 1) for s in bare_first_writes(tokens)])

    engine = foretell.load("demo")
    prompt = [random.Random(0).randrange(10, 1000) for _ in range(tokens)]

    def generate(n: int = 1):
        return list(engine.generate(prompt, max_tokens=n, ignore_eos=True))[-1]

    engine.cache = CacheTier.for_engine(engine)
    generate()  # cold: stores the entry
    forwards: list[float] = []
    forward = engine.model.forward

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        mx.eval(out)
        forwards.append(time.perf_counter() - start)
        return out

    engine.model.forward = timed_forward
    for _ in range(5):
        forwards.clear()
        generate(4)
        print("hit, each forward (ms):", [round(s * 1e3, 1) for s in forwards])
    engine.model.forward = forward

    pool: list[mx.array] = []
    plain_update = kvcache.KVCache.update_and_fetch

    def landing_update(cache, keys, values):
        start, end = cache.offset, cache.offset + keys.shape[2]
        if pool and end <= pool[-1].shape[2]:
            own_keys, own_values = pool.pop(), pool.pop()
            own_keys[..., :start, :] = cache.keys[..., :start, :]  # donated: no allocation
            own_values[..., :start, :] = cache.values[..., :start, :]
            cache.keys, cache.values = own_keys, own_values
        return plain_update(cache, keys, values)

    kvcache.KVCache.update_and_fetch = landing_update
    ttft: dict[str, list[float]] = {"plain": [], "landing": []}
    for turn in range(24):
        way = ("plain", "landing")[turn % 2]
        pool.clear()
        mx.clear_cache()
        if way == "landing":
            pool.extend(mx.zeros((1, 4, tokens + SLACK, 64)) for _ in range(12))
            mx.eval(pool)
        ttft[way].append(generate().ttft_s)
    kvcache.KVCache.update_and_fetch = plain_update
    for way, spent in ttft.items():
        print(f"RAM hit TTFT, {way}: median {statistics.median(spent) * 1e3:.1f} ms "
              f"({min(spent) * 1e3:.1f}-{max(spent) * 1e3:.1f})")


if __name__ == "__main__":
    main()
