"""The baseline codecs: snapshots hold the valid prefix, restored caches continue exactly,
clones never touch their donor, and stored headers say what can be trimmed."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from cachefill import feed, filled_kv, filled_rotating, random_kv

from foretell.cache.codecs import (
    CodecError,
    RotatingKVCodec,
    StandardKVCodec,
    clone_caches,
    codec_for,
    entry_minimum_reusable_offset,
    entry_trimmable,
    load_codecs,
    restore_caches,
    snapshot_entry,
)
from foretell.model import KVCache, RotatingKVCache
from foretell.plugin.testing import fresh_plugins
from foretell.store.single_file import SingleFileLayout


def same(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.asarray(a.astype(mx.float32)), np.asarray(b.astype(mx.float32))
    )


def through_disk(tmp_path, identity, codecs, caches, tokens):
    """Snapshot, write, reopen the store as a fresh process would, read, restore."""
    SingleFileLayout(tmp_path, identity=identity).write(snapshot_entry(tokens, caches, codecs))
    reopened = SingleFileLayout(tmp_path, identity=identity)
    (header,) = reopened.scan()
    return restore_caches(reopened.read(header.key), codecs)


def assert_continues_identically(original, restored, steps=5, dtype=mx.float32):
    assert restored.offset == original.offset
    for step in range(steps):
        n = 3 if step == 0 else 1  # a multi-token verify window, then decode tokens
        expected = feed(original, n, seed=900 + step, dtype=dtype)
        got = feed(restored, n, seed=900 + step, dtype=dtype)
        assert same(got[0], expected[0]) and same(got[1], expected[1])
        assert restored.offset == original.offset


def test_registered_baseline_codecs_load_from_the_registry():
    codecs = load_codecs(fresh_plugins().registry)
    assert {type(c) for c in codecs} >= {StandardKVCodec, RotatingKVCodec}


def test_kv_snapshot_holds_only_the_valid_prefix():
    cache = filled_kv(10)  # buffer has 256 slots, 10 of them used
    tensors, meta = StandardKVCodec().snapshot(cache)
    assert tensors["keys"].shape[2] == 10 and tensors["values"].shape[2] == 10
    assert meta == {"offset": 10}


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_kv_round_trip_through_disk_continues_decoding_exactly(tmp_path, identity, codecs, dtype):
    original = filled_kv(37, dtype=dtype)
    (restored,) = through_disk(tmp_path, identity, codecs, [original], range(37))
    assert isinstance(restored, KVCache)
    assert same(restored.state[0], original.state[0]) and same(restored.state[1], original.state[1])
    assert_continues_identically(original, restored, dtype=dtype)


@pytest.mark.parametrize("seen", [5, 16, 23, 40], ids=["partial", "full", "wrapped", "wrapped-twice"])
def test_rotating_round_trip_through_disk_continues_exactly(tmp_path, identity, codecs, seen):
    original = filled_rotating(seen, max_size=16)
    (restored,) = through_disk(tmp_path, identity, codecs, [original], range(seen))
    assert isinstance(restored, RotatingKVCache)
    assert restored.meta == original.meta
    assert same(restored.ordered_state()[0], original.ordered_state()[0])
    assert_continues_identically(original, restored)


def test_rotating_round_trip_after_a_sliding_prefill_chunk(tmp_path, identity, codecs):
    original = RotatingKVCache(8)
    feed(original, 6, seed=1)
    feed(original, 5, seed=2)  # evicts inside one multi-token update
    (restored,) = through_disk(tmp_path, identity, codecs, [original], range(11))
    assert_continues_identically(original, restored)


def test_rotating_header_is_trimmable_until_the_ring_wraps():
    codec = RotatingKVCodec()
    full = codec.snapshot(filled_rotating(16, max_size=16))[1]
    wrapped = codec.snapshot(filled_rotating(17, max_size=16))[1]
    assert codec.header_trimmable(full) is True
    assert codec.header_trimmable(wrapped) is False
    assert codec.minimum_reusable_offset(full) == 0
    # A wrapped ring lost its oldest tokens: only its exact length can be reused.
    assert codec.minimum_reusable_offset(wrapped) == 17


def test_header_trimmable_agrees_with_the_live_cache():
    codec = RotatingKVCodec()
    for seen in (1, 15, 16, 17, 30):
        cache = filled_rotating(seen, max_size=16)
        assert codec.header_trimmable(codec.snapshot(cache)[1]) == cache.is_trimmable()


def test_kv_header_is_always_trimmable_to_any_prefix():
    meta = StandardKVCodec().snapshot(filled_kv(9))[1]
    assert StandardKVCodec().header_trimmable(meta) is True
    assert StandardKVCodec().minimum_reusable_offset(meta) == 0


def test_entry_trimmable_needs_every_layer_trimmable(codecs):
    caches = [filled_kv(20), filled_rotating(20, max_size=16)]
    entry = snapshot_entry(range(20), caches, codecs)
    assert entry_trimmable(entry.layers, codecs) is False
    assert entry_minimum_reusable_offset(entry.layers, codecs) == 20
    short = snapshot_entry(range(12), [filled_kv(12), filled_rotating(12, max_size=16)], codecs)
    assert entry_trimmable(short.layers, codecs) is True
    assert entry_minimum_reusable_offset(short.layers, codecs) == 0


@pytest.mark.parametrize("make", [lambda: filled_kv(12), lambda: filled_rotating(12, max_size=16),
                                  lambda: filled_rotating(20, max_size=16)],
                         ids=["kv", "rotating", "rotating-wrapped"])
def test_extending_a_clone_leaves_the_donor_unchanged(codecs, make):
    donor = make()
    before_state = [np.array(t) for t in donor.state]
    before_meta = dict(donor.meta)
    (clone,) = clone_caches([donor], codecs)
    feed(clone, 3, seed=7)
    feed(clone, 1, seed=8)
    mx.eval(clone.state)
    assert donor.meta == before_meta
    assert all(np.array_equal(np.array(t), b) for t, b in zip(donor.state, before_state))
    assert clone.offset == donor.offset + 4


def test_clone_shares_buffers_until_written(codecs):
    donor = filled_kv(12)
    (clone,) = clone_caches([donor], codecs)
    assert same(clone.state[0], donor.state[0])
    # Extending the donor must not leak into the clone either.
    feed(donor, 2, seed=5)
    assert clone.offset == 12 and donor.offset == 14


def test_trimming_a_clone_leaves_the_donor_unchanged(codecs):
    donor = filled_kv(12)
    (clone,) = clone_caches([donor], codecs)
    clone.trim(5)
    feed(clone, 2, seed=3)
    assert donor.offset == 12
    assert same(donor.state[0][..., 7:9, :], filled_kv(12).state[0][..., 7:9, :])


def test_codec_for_refuses_a_cache_no_codec_handles(codecs):
    class Unknown:
        pass

    with pytest.raises(CodecError, match="no cache codec handles .*Unknown.*installed codecs: kv, rotating-kv"):
        codec_for(Unknown(), codecs)


def test_codec_for_refuses_a_cache_claimed_twice():
    class Greedy(StandardKVCodec):
        name = "greedy"

        def matches(self, cache):
            return True

    with pytest.raises(CodecError, match="claimed by several cache codecs: kv, greedy"):
        codec_for(KVCache(), [StandardKVCodec(), Greedy()])


def test_codec_for_does_not_claim_subclasses(codecs):
    class Quantized(KVCache):
        pass

    with pytest.raises(CodecError, match="no cache codec handles"):
        codec_for(Quantized(), codecs)


def test_restore_refuses_a_layer_from_an_unloaded_provider(codecs):
    entry = snapshot_entry(range(4), [filled_kv(4)], codecs)
    with pytest.raises(CodecError, match="foretell.baseline/kv@1.*not loaded"):
        restore_caches(entry, [RotatingKVCodec()])


def test_load_refuses_tensors_of_another_shape_of_state():
    keys, _ = random_kv(4, seed=1)
    with pytest.raises(CodecError, match="expects tensors 'keys' and 'values'"):
        StandardKVCodec().load({"latent": keys}, {"offset": 4})


def test_empty_cache_round_trips(codecs):
    (restored,) = restore_caches(snapshot_entry([], [KVCache()], codecs), codecs)
    assert restored.offset == 0 and restored.state == ()


@pytest.fixture(scope="module", params=["qwen3", "gemma3_text", "gemma4_text"])
def tiny_model(request, tmp_path_factory):
    from foretell.model.loading import load
    from foretell.tools import make_model_dir

    return load(make_model_dir(tmp_path_factory.mktemp(request.param), request.param))


def greedy(model, caches, last: int, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        hidden, _ = model.forward(mx.array([[last]]), caches)
        last = int(mx.argmax(model.logits(hidden)[0, -1]))
        out.append(last)
    return out


def test_model_resumes_from_a_stored_entry_token_for_token(tiny_model, tmp_path, identity, codecs):
    # 11 prompt tokens: the Gemma sliding layers (window 8) have wrapped when stored.
    prompt = [5, 17, 99, 3, 250, 42, 8, 8, 301, 77, 12]
    straight = tiny_model.make_caches()
    tiny_model.forward(mx.array([prompt[:-1]]), straight)
    # Stored at the prompt boundary (len - 1: the last token heads the first decode step).
    entry = snapshot_entry(prompt[:-1], straight, codecs)
    if any(isinstance(c, RotatingKVCache) for c in straight):
        assert not entry_trimmable(entry.layers, codecs)
    assert SingleFileLayout(tmp_path, identity=identity).write(entry) is True
    expected = greedy(tiny_model, straight, prompt[-1], steps=8)

    layout = SingleFileLayout(tmp_path, identity=identity)
    restored = restore_caches(layout.read(layout.key_for(prompt[:-1])), codecs)
    assert [type(c) for c in restored] == [type(c) for c in straight]
    assert greedy(tiny_model, restored, prompt[-1], steps=8) == expected
