"""KV caches against a reference: full attention over every key with an explicit mask."""

import mlx.core as mx
import numpy as np
import pytest

from foretell.model import (
    KVCache,
    RotatingKVCache,
    attend,
    attention_mask,
    causal_mask,
    stay_trimmable,
    trim_all,
)

HEADS, KV_HEADS, DIM = 4, 2, 8


def sequence(length, seed=0):
    key_q, key_k, key_v = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, HEADS, length, DIM), key=key_q)
    k = mx.random.normal((1, KV_HEADS, length, DIM), key=key_k)
    v = mx.random.normal((1, KV_HEADS, length, DIM), key=key_v)
    return q, k, v


def reference_attention(q, k, v, window=None):
    """Plain softmax attention of every query over all keys, no cache involved."""
    n = q.shape[2]
    mask = np.array(causal_mask(n, 0, window))
    repeat = HEADS // KV_HEADS
    qn = np.array(q)[0]
    kn = np.repeat(np.array(k)[0], repeat, axis=0)
    vn = np.repeat(np.array(v)[0], repeat, axis=0)
    scores = qn @ kn.transpose(0, 2, 1) / np.sqrt(DIM)
    scores = np.where(mask, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return weights @ vn


def run_through_cache(cache, q, k, v, chunks, window=None):
    outputs, start = [], 0
    for size in chunks:
        stop = start + size
        mask = attention_mask(size, cache, window)
        keys, values = cache.update_and_fetch(k[..., start:stop, :], v[..., start:stop, :])
        outputs.append(attend(q[..., start:stop, :], keys, values, scale=DIM**-0.5, mask=mask))
        start = stop
    return np.array(mx.concatenate(outputs, axis=2))[0]


def test_causal_mask_limits_each_query_to_its_window():
    mask = np.array(causal_mask(3, 4, window=3))
    for i in range(3):
        position = 4 + i
        expected = [position - 3 < j <= position for j in range(7)]
        assert mask[i].tolist() == expected


@pytest.mark.parametrize("chunks", [[1] * 20, [7, 1, 1, 5, 6], [20], [3, 3, 14]])
def test_kv_cache_updates_match_full_attention(chunks):
    q, k, v = sequence(sum(chunks))
    got = run_through_cache(KVCache(), q, k, v, chunks)
    np.testing.assert_allclose(got, reference_attention(q, k, v), atol=1e-5)


def test_kv_cache_grows_past_its_step_without_losing_history():
    cache = KVCache()
    cache.step = 4
    q, k, v = sequence(11)
    got = run_through_cache(cache, q, k, v, [3, 1, 1, 6])
    np.testing.assert_allclose(got, reference_attention(q, k, v), atol=1e-5)
    assert cache.offset == 11 and cache.keys.shape[2] == 12


@pytest.mark.parametrize(
    "chunks",
    [
        [1] * 30,  # decode only, wraps the ring several times
        [20, 1, 1, 1, 7],  # prefill longer than the window, then decode, then a chunk
        [5, 3, 1, 4, 1, 1, 9, 2, 4],  # verify-sized windows that straddle the wrap
        [8, 8, 8],  # chunks exactly the window
        [30],
    ],
)
def test_rotating_cache_updates_match_windowed_full_attention(chunks):
    window = 8
    q, k, v = sequence(sum(chunks), seed=1)
    got = run_through_cache(RotatingKVCache(window), q, k, v, chunks, window)
    np.testing.assert_allclose(got, reference_attention(q, k, v, window), atol=1e-5)


def test_rotating_cache_keeps_only_the_window():
    cache = RotatingKVCache(6)
    _, k, v = sequence(20)
    for i in range(20):
        cache.update_and_fetch(k[..., i : i + 1, :], v[..., i : i + 1, :])
    keys, _ = cache.ordered_state()
    assert cache.offset == 20 and cache.size() == 6
    np.testing.assert_array_equal(np.array(keys), np.array(k[..., 14:, :]))


def test_rotating_cache_trim_before_wrap_is_exact():
    window = 8
    q, k, v = sequence(10, seed=2)
    trimmed = RotatingKVCache(window)
    trimmed.update_and_fetch(k[..., :6, :], v[..., :6, :])
    trimmed.update_and_fetch(k[..., 6:8, :], v[..., 6:8, :])  # exactly full, nothing evicted
    assert trimmed.is_trimmable()
    assert trimmed.trim(3) == 3 and trimmed.offset == 5
    # After rollback, continuing must equal a cache that only ever saw the kept prefix.
    fresh = RotatingKVCache(window)
    fresh.update_and_fetch(k[..., :5, :], v[..., :5, :])
    outputs = []
    for cache in (trimmed, fresh):
        mask = attention_mask(5, cache, window)
        keys, values = cache.update_and_fetch(k[..., 5:10, :], v[..., 5:10, :])
        outputs.append(np.array(attend(q[..., 5:10, :], keys, values, scale=DIM**-0.5, mask=mask)))
    np.testing.assert_array_equal(outputs[0], outputs[1])


def test_rotating_cache_refuses_to_trim_after_wrapping():
    cache = RotatingKVCache(4)
    _, k, v = sequence(5)
    cache.update_and_fetch(k, v)
    before = [np.array(x) for x in cache.state]
    assert not cache.is_trimmable()
    assert cache.trim(2) == 0 and cache.offset == 5
    for old, new in zip(before, cache.state):
        np.testing.assert_array_equal(old, np.array(new))


def test_trim_all_refuses_when_any_cache_has_wrapped():
    full, ring = KVCache(), RotatingKVCache(2)
    _, k, v = sequence(3)
    for cache in (full, ring):
        cache.update_and_fetch(k, v)
    assert trim_all([full, ring], 1) == 0 and full.offset == 3


def attend_chunk(cache, q, k, v, start, stop):
    mask = attention_mask(stop - start, cache)
    keys, values = cache.update_and_fetch(k[..., start:stop, :], v[..., start:stop, :])
    return np.array(attend(q[..., start:stop, :], keys, values, scale=DIM**-0.5, mask=mask))


CACHES = {
    "kv": KVCache,
    "rotating": lambda: RotatingKVCache(12),
    "rotating-wrapped": lambda: RotatingKVCache(6),
}


@pytest.mark.parametrize("make", CACHES.values(), ids=CACHES.keys())
def test_cache_restored_from_state_continues_identically(make):
    q, k, v = sequence(14, seed=3)
    donor = make()
    attend_chunk(donor, q, k, v, 0, 9)
    restored = type(donor).from_state(donor.state, donor.meta)
    assert restored.offset == donor.offset == 9
    for start, stop in [(9, 12), (12, 13), (13, 14)]:
        np.testing.assert_array_equal(
            attend_chunk(donor, q, k, v, start, stop), attend_chunk(restored, q, k, v, start, stop)
        )


@pytest.mark.parametrize("make", CACHES.values(), ids=CACHES.keys())
def test_writing_into_a_restored_cache_leaves_the_donor_untouched(make):
    q, k, v = sequence(9, seed=4)
    donor = make()
    attend_chunk(donor, q, k, v, 0, 9)
    before = [np.array(x) for x in donor.state]
    restored = type(donor).from_state(donor.state, donor.meta)
    restored.trim(4)
    other_q, other_k, other_v = sequence(9, seed=5)
    for i in range(9):
        attend_chunk(restored, other_q, other_k, other_v, i, i + 1)
    for old, now in zip(before, donor.state):
        np.testing.assert_array_equal(old, np.array(now))


def test_a_window_that_would_evict_is_flagged_before_it_runs():
    ring, full = RotatingKVCache(8), KVCache()
    _, k, v = sequence(6)
    for cache in (ring, full):
        cache.update_and_fetch(k, v)
    assert ring.stays_trimmable(2) and not ring.stays_trimmable(3)
    assert not stay_trimmable([full, ring], 3) and stay_trimmable([full, ring], 2)
