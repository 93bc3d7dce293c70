"""Affine-quantized KV: the cache stores what mx.quantize gives, attends like mlx-lm's
quantized attention, trims and clones along tokens exactly, and round-trips through its
codec and the single-file layout."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from foretell.cache.codecs import restore_caches, snapshot_entry
from foretell.cache.quantized import (
    QuantizedKVCache,
    QuantizedKVCodec,
    kv_scheme,
    quantize_caches,
    quantized_attend,
)
from foretell.model import KVCache, RotatingKVCache
from foretell.store.entry import StoreIdentity
from foretell.store.single_file import SingleFileLayout

DIM, HEADS = 64, 2


def kv(n, seed):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return (mx.random.normal((1, HEADS, n, DIM), key=k1),
            mx.random.normal((1, HEADS, n, DIM), key=k2))


def filled(n, bits=8):
    cache = QuantizedKVCache(bits, 64)
    cache.update_and_fetch(*kv(n, seed=n))
    return cache


@pytest.mark.parametrize("bits", [4, 8])
def test_the_history_is_stored_as_mx_quantize_gives_it(bits):
    keys, values = kv(10, seed=1)
    cache = QuantizedKVCache(bits, 64)
    cache.update_and_fetch(keys, values)
    expected = mx.quantize(keys, group_size=64, bits=bits)
    for got, want in zip(cache.state[:3], expected):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_first_update_attends_over_exact_values_and_later_ones_over_quantized():
    cache = QuantizedKVCache(8, 64)
    keys, values = kv(5, seed=2)
    first = cache.update_and_fetch(keys, values)
    assert first[0] is keys  # mlx-lm converts its cache only after the first chunk
    later = cache.update_and_fetch(*kv(1, seed=3))
    assert isinstance(later[0], tuple) and later[0][0].shape[2] == 6


@pytest.mark.parametrize("mode", ["quantized", "dequantized"])
@pytest.mark.parametrize("n_queries,mask", [(1, None), (4, "causal")])
def test_quantized_attention_matches_attention_over_the_dequantized_cache(
        n_queries, mask, mode, monkeypatch):
    """Both ways it attends: mlx-lm's quantized products, and (CUDA's default, whose MLX
    build has no batched quantized_matmul) the products over the dequantized KV."""
    from foretell.cache import quantized

    monkeypatch.setattr(quantized, "_PRODUCTS_MODE", mode)
    if mode == "dequantized":
        monkeypatch.setattr(quantized.mx, "quantized_matmul", _refused)
    cache = filled(20)
    cache.update_and_fetch(*kv(n_queries, seed=9))
    keys, values = cache._view(cache.keys, cache.offset), cache._view(cache.values, cache.offset)
    queries = mx.random.normal((1, 2 * HEADS, n_queries, DIM), key=mx.random.key(4))
    got = quantized_attend(queries, keys, values, scale=DIM ** -0.5, mask=mask)
    dk = mx.dequantize(*keys, group_size=64, bits=8)
    dv = mx.dequantize(*values, group_size=64, bits=8)
    want = mx.fast.scaled_dot_product_attention(queries, dk, dv, scale=DIM ** -0.5, mask=mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)


@pytest.mark.parametrize("forced,expected", [("dequantized", True), ("quantized", False)])
def test_the_products_mode_is_read_once_and_can_be_forced(forced, expected, monkeypatch):
    from foretell.cache import quantized

    monkeypatch.setattr(quantized, "_PRODUCTS_MODE", None)
    monkeypatch.setenv("FORETELL_QUANTIZED_PRODUCTS", forced)
    assert quantized.products_dequantized() is expected
    monkeypatch.setenv("FORETELL_QUANTIZED_PRODUCTS", "auto")  # read once: no change now
    assert quantized.products_dequantized() is expected


def _refused(*_args, **_kwargs):
    raise RuntimeError("[quantized_matmul] No implementation for problem shape (as MLX-CUDA)")


def test_trim_drops_exactly_the_newest_tokens():
    cache = filled(20)
    reference = filled(20)
    cache.update_and_fetch(*kv(5, seed=11))
    assert cache.trim(5) == 5 and cache.offset == 20
    for got, want in zip(cache.state, reference.state):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_extending_a_clone_leaves_the_donor_unchanged():
    donor = filled(20)
    before = [np.asarray(a) for a in donor.state]
    clone = QuantizedKVCodec().clone(donor)
    clone.trim(4)
    clone.update_and_fetch(*kv(30, seed=12))
    assert donor.offset == 20
    for got, want in zip(donor.state, before):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_a_stored_quantized_cache_reads_back_identical(tmp_path):
    codecs = [QuantizedKVCodec()]
    identity = StoreIdentity(model_fingerprint="0123456789abcdef", kv_scheme=kv_scheme(4),
                             model_id="t", tokenizer_hash="x",
                             codec_providers=[c.provider_id for c in codecs])
    layout = SingleFileLayout(tmp_path, identity=identity)
    cache = filled(33, bits=4)
    entry = snapshot_entry(range(33), [cache], codecs)
    assert layout.write(entry)
    (restored,) = restore_caches(layout.read(layout.key_for(range(33))), codecs)
    assert (restored.bits, restored.group_size, restored.offset) == (4, 64, 33)
    for got, want in zip(restored.state, cache.state):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_only_empty_full_attention_caches_are_quantized():
    caches = quantize_caches([KVCache(), RotatingKVCache(8)], bits=4)
    assert type(caches[0]) is QuantizedKVCache and type(caches[1]) is RotatingKVCache


def test_bits_other_than_4_or_8_are_refused():
    with pytest.raises(ValueError, match="4 or 8"):
        QuantizedKVCache(3)


def test_a_head_dim_the_group_size_does_not_divide_is_one_clear_error():
    from foretell.errors import GenerationError

    cache = QuantizedKVCache(4, 64)
    with pytest.raises(GenerationError, match="head_dim \\(16\\).*group size 64"):
        cache.update_and_fetch(mx.zeros((1, 2, 3, 16)), mx.zeros((1, 2, 3, 16)))
