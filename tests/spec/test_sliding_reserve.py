"""Sliding-window layers roll back exactly under speculation (DESIGN.md invariant 3).

The oracle is the model run without any cache over the kept sequence: after any mix of
multi-token rounds and rollbacks, the logits from :class:`SlidingKVCache` caches equal a
fresh full forward, long after the window has wrapped."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np

from foretell.cache.codecs import SlidingKVCodec
from foretell.kvcache import (
    RotatingKVCache,
    SlidingKVCache,
    add_rollback_reserve,
    stay_trimmable,
    trim_all,
)


def _full_logits(model, tokens):
    hidden, _ = model.forward(mx.array([tokens], dtype=mx.int32))
    return model.logits(hidden)[0]


def test_rounds_and_rollbacks_match_a_fresh_forward_past_the_window(engines):
    model = engines["gemma3_text"].model  # window 8
    rng = random.Random(0)
    caches = add_rollback_reserve(model.make_caches(), 6)
    assert any(type(c) is SlidingKVCache for c in caches)
    sequence: list[int] = []
    checked = 0
    while len(sequence) < 90:
        n = rng.randint(1, 7)
        assert stay_trimmable(caches, n)
        window = [rng.randrange(1, 400) for _ in range(n)]
        hidden, _ = model.forward(mx.array([window], dtype=mx.int32), caches)
        got = model.logits(hidden)[0]
        expected = _full_logits(model, sequence + window)[-n:]
        np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-4, atol=1e-4)
        checked += 1
        rejected = rng.randint(0, n - 1)
        assert trim_all(caches, rejected) == rejected
        sequence += window[: n - rejected]
    assert checked > 10 and all(c.offset == len(sequence) for c in caches)


def test_a_ring_becomes_a_sliding_cache_holding_the_same_window(engines):
    model = engines["gemma3_text"].model
    tokens = [random.Random(1).randrange(1, 400) for _ in range(30)]
    caches = model.make_caches()
    model.forward(mx.array([tokens], dtype=mx.int32), caches)
    assert any(type(c) is RotatingKVCache and not c.is_trimmable() for c in caches)
    add_rollback_reserve(caches, 4)
    hidden, _ = model.forward(mx.array([[7, 8, 9]], dtype=mx.int32), caches)
    expected = _full_logits(model, tokens + [7, 8, 9])[-3:]
    np.testing.assert_allclose(np.array(model.logits(hidden)[0]), np.array(expected),
                               rtol=1e-4, atol=1e-4)


def test_a_sliding_cache_snapshot_restores_and_continues_identically():
    codec = SlidingKVCodec()
    cache = SlidingKVCache(8, reserve=3)
    keys = mx.random.normal((1, 2, 40, 4), key=mx.random.key(0))
    for i in range(0, 40, 5):
        cache.update_and_fetch(keys[:, :, i : i + 5], keys[:, :, i : i + 5] * 2)
    cache.trim(2)
    tensors, meta = codec.snapshot(cache)
    restored = codec.load(tensors, meta)
    assert codec.minimum_reusable_offset(meta) == cache.offset - cache.trimmable()
    step = mx.random.normal((1, 2, 3, 4), key=mx.random.key(1))
    a = cache.update_and_fetch(step, step)
    b = restored.update_and_fetch(step, step)
    assert restored.offset == cache.offset == 41
    assert all(mx.array_equal(x, y) for x, y in zip(a, b))
