"""Caches filled with random keys/values, as generation would fill them."""

from __future__ import annotations

import mlx.core as mx

from foretell.model import KVCache, RotatingKVCache

HEADS, DIM = 2, 8


def random_kv(n: int, seed: int, dtype=mx.float32) -> tuple[mx.array, mx.array]:
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    shape = (1, HEADS, n, DIM)
    return mx.random.normal(shape, key=k1).astype(dtype), mx.random.normal(shape, key=k2).astype(dtype)


def feed(cache, n: int, seed: int, dtype=mx.float32) -> tuple[mx.array, mx.array]:
    """Append ``n`` random tokens to ``cache``; return what attention would read."""
    keys, values = random_kv(n, seed, dtype)
    return cache.update_and_fetch(keys, values)


def filled_kv(n: int, dtype=mx.float32) -> KVCache:
    cache = KVCache()
    feed(cache, n, seed=n, dtype=dtype)
    return cache


def filled_rotating(n: int, max_size: int, dtype=mx.float32) -> RotatingKVCache:
    """A ring fed one prefill chunk then single decode tokens, as generation feeds it."""
    cache = RotatingKVCache(max_size)
    chunk = min(n, max_size // 2) or n
    feed(cache, chunk, seed=1, dtype=dtype)
    for i in range(n - chunk):
        feed(cache, 1, seed=100 + i, dtype=dtype)
    return cache
