"""Sliding-window layers roll back exactly under speculation (DESIGN.md invariant 3).

The oracle is the model run without any cache over the kept sequence: after any mix of
multi-token rounds and rollbacks, the logits from :class:`SlidingKVCache` caches equal a
fresh full forward, long after the window has wrapped."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from foretell.cache.codecs import SlidingKVCodec
from foretell.model import (
    RotatingKVCache,
    SlidingKVCache,
    add_rollback_reserve,
    kvcache,
    stay_trimmable,
    trim_all,
)

#: Largest difference between two bfloat16 attention outputs that counts as agreeing.
AGREES_WITHIN = 2e-2


def fused_vs_own_arrays(query, keys, values, scale: float) -> float:
    """The fused kernel's answer over ``keys``/``values`` as given (views, say) against its
    answer over the same keys in arrays of their own (copied out through the host): the
    largest difference (NaN where the kernel misread the views)."""
    own = [mx.array(np.array(a.astype(mx.float32))).astype(a.dtype) for a in (keys, values)]
    got = mx.fast.scaled_dot_product_attention(query, keys, values, scale=scale)
    expected = mx.fast.scaled_dot_product_attention(query, *own, scale=scale)
    return mx.abs(got.astype(mx.float32) - expected.astype(mx.float32)).max().item()


def window_view(kv_heads: tuple[int, ...] = (1, 2, 8), head_dims: tuple[int, ...] = (64, 128)
                ) -> list[dict]:
    """For each case, a single-token query's fused attention over ``keys[..., 89:600, :]``
    of a 768-token buffer (:func:`fused_vs_own_arrays`): the largest difference, and
    whether it is within bfloat16 rounding."""
    cases = []
    for hk in kv_heads:
        for dim in head_dims:
            k, v = (mx.random.normal((1, hk, 768, dim), key=mx.random.key(seed))
                    .astype(mx.bfloat16) for seed in (0, 1))
            q = mx.random.normal((1, 2 * hk, 1, dim), key=mx.random.key(2)).astype(mx.bfloat16)
            diff = fused_vs_own_arrays(q, k[..., 89:600, :], v[..., 89:600, :], dim ** -0.5)
            cases.append({"kv_heads": hk, "head_dim": dim, "max_diff": diff,
                          "agrees": bool(diff <= AGREES_WITHIN)})
    return cases


def _full_logits(model, tokens):
    hidden, _ = model.forward(mx.array([tokens], dtype=mx.int32))
    return model.logits(hidden)[0]


@pytest.mark.parametrize("handed", ["view", "copy"])
def test_rounds_and_rollbacks_match_a_fresh_forward_past_the_window(engines, monkeypatch,
                                                                    handed):
    """Both ways of handing attention the window (a view into the buffer; a copy, which
    CUDA takes: ``window_copies``) compute the same, and copies happen only when asked."""
    monkeypatch.setattr(kvcache, "_WINDOW_MODE", handed)
    copies = []
    real = mx.contiguous
    monkeypatch.setattr(mx, "contiguous", lambda a, *args, **kw: copies.append(a.shape)
                        or real(a, *args, **kw))
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
    assert bool(copies) == (handed == "copy")


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


def _on_cuda() -> bool:
    from foretell.platform.device import on_cuda

    return on_cuda()


@pytest.mark.skipif(not _on_cuda(), reason="the fused kernel's defect is MLX-CUDA's")
def test_on_cuda_a_single_token_query_attends_to_the_window_itself():
    """MLX-CUDA's fused attention read a window that starts past its buffer's start wrongly
    (NaN); the cache hands it a copy there, so its answer equals attention over the same keys
    in arrays of their own."""
    cache = SlidingKVCache(16, reserve=4)
    keys = mx.random.normal((1, 2, 60, 64), key=mx.random.key(2)).astype(mx.bfloat16)
    for i in range(59):
        cache.update_and_fetch(keys[:, :, i : i + 1], keys[:, :, i : i + 1] * 2)
    k, v = cache.update_and_fetch(keys[:, :, 59:], keys[:, :, 59:] * 2)
    assert k.shape[2] == 16
    query = mx.random.normal((1, 4, 1, 64), key=mx.random.key(3)).astype(mx.bfloat16)
    assert fused_vs_own_arrays(query, k, v, 0.125) <= AGREES_WITHIN


def test_the_fused_kernel_reads_a_window_view_as_the_copy_rule_assumes():
    """The CPU's fused kernel reads a window view as it reads a copy of it (so the CPU keeps
    the view); MLX-CUDA 0.32.4's does not (so CUDA copies). Run this on CUDA after an MLX
    upgrade: it fails once MLX fixes its kernel, and the copy may then go."""
    cases = window_view(kv_heads=(1, 2), head_dims=(64,))
    assert len(cases) == 2
    agree = [c["agrees"] for c in cases]
    assert all(agree) != _on_cuda(), cases
