"""The draft-state layer: a drafter's state stored with the target's entry. It round-trips
through the entry file (KV through the tier's codecs, other tensors, meta), goes stale when
its entry serves a shorter prefix, wins an exact boundary over a longer entry served trimmed,
and is superseded by nothing longer, in RAM and on disk."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from cachefill import filled_kv

from foretell.cache.attachment import (
    ATTACHMENT_PROVIDER,
    DraftAttachmentCodec,
    attach,
    split_attachment,
    unpack,
)
from foretell.cache.codecs import RotatingKVCodec, StandardKVCodec
from foretell.cache.tier import CacheTier
from foretell.spec.contract import DraftState
from foretell.store.entry import StoreIdentity
from foretell.store.single_file import SingleFileLayout


@pytest.fixture
def codecs():
    return [StandardKVCodec(), RotatingKVCodec(), DraftAttachmentCodec()]


@pytest.fixture
def identity(codecs):
    return StoreIdentity(model_fingerprint="0123456789abcdef", model_id="test/tiny",
                         tokenizer_hash="tok-aaaa", codec_providers=[c.provider_id for c in codecs])


def tier_over(tmp_path, identity, codecs):
    return CacheTier(codecs, layout=SingleFileLayout(tmp_path, identity=identity))


def attachment(n, codecs, *, name="draft-a", keys=None):
    state = DraftState(caches=[filled_kv(n - 1)], tensors={"last": mx.arange(8.0)},
                       meta={"fed": n - 1}, keys=keys)
    return attach(state, identity=name, offset=n, ahead=[99], seen=n + 1, feed_hidden=None,
                  codecs=codecs, keys=keys)


def test_the_draft_state_layer_round_trips_through_the_entry_file(tmp_path, identity, codecs):
    writer = tier_over(tmp_path, identity, codecs)
    stored = attachment(12, codecs, keys=[1, 2])
    writer.store(range(12), [filled_kv(12), stored])
    assert writer.close(10).durable
    reuse = tier_over(tmp_path, identity, codecs).lookup([*range(12), 99, 3])
    assert (reuse.tokens, reuse.tier) == (12, "ssd")
    caches, found = split_attachment(reuse.caches)
    assert len(caches) == 1 and found is not None
    assert (found.identity, found.offset, found.ahead, found.seen) == ("draft-a", 12, [99], 13)
    state = unpack(found, codecs, with_keys=True)
    np.testing.assert_array_equal(np.asarray(state.caches[0].state[0]),
                                  np.asarray(unpack(stored, codecs, with_keys=True).caches[0].state[0]))
    assert state.caches[0].offset == 11 and state.meta == {"fed": 11}
    np.testing.assert_array_equal(np.asarray(state.tensors["last"]), np.arange(8.0))
    assert state.keys == [1, 2]
    # A new request (not a resumed generation) draws from its own stream.
    assert unpack(found, codecs, with_keys=False).keys is None


def test_serving_an_attached_entry_shorter_leaves_its_attachment_stale(tmp_path, identity, codecs):
    tier = tier_over(tmp_path, identity, codecs)
    tier.store(range(12), [filled_kv(12), attachment(12, codecs)])
    exact = tier.lookup([*range(12), 99])
    shorter = tier.lookup([*range(8), 50, 51])
    assert exact.tokens == 12 and split_attachment(exact.caches)[1] is not None
    assert shorter.tokens == 8 and split_attachment(shorter.caches)[1] is None
    # The donor is untouched: the next exact hit still has it.
    assert split_attachment(tier.lookup([*range(12), 99]).caches)[1] is not None


def test_a_longer_entry_never_supersedes_an_attached_one(tmp_path, identity, codecs):
    tier = tier_over(tmp_path, identity, codecs)
    tier.store(range(12), [filled_kv(12), attachment(12, codecs)])
    tier.store(range(20), [filled_kv(20), attachment(20, codecs)])
    assert tier.flush(10).durable
    assert sorted(len(e.tokens) for e in tier.ram.entries()) == [12, 20]
    assert sorted(len(s.tokens) for s in tier.ssd.entries()) == [12, 20]
    assert all(s.attached for s in tier.ssd.entries())
    # Without attachments the longer entry serves the shorter one and replaces it.
    plain = tier_over(tmp_path / "plain", identity, codecs)
    plain.store(range(12), [filled_kv(12)])
    plain.store(range(20), [filled_kv(20)])
    assert [len(e.tokens) for e in plain.ram.entries()] == [20]


def test_an_exact_boundary_wins_over_a_longer_entry_served_trimmed(tmp_path, identity, codecs):
    tier = CacheTier(codecs)
    tier.store(range(20), [filled_kv(20), attachment(20, codecs, name="long")])
    tier.store(range(12), [filled_kv(12), attachment(12, codecs, name="exact")])
    # Both serve 12 tokens of this prompt; only the 12-token entry keeps its drafter state.
    reuse = tier.lookup([*range(12), 99])
    found = split_attachment(reuse.caches)[1]
    assert reuse.tokens == 12 and found is not None and found.identity == "exact"


def test_the_layer_is_recorded_under_its_own_provider(codecs):
    tensors, meta = DraftAttachmentCodec().snapshot(attachment(5, codecs))
    assert DraftAttachmentCodec.provider_id == ATTACHMENT_PROVIDER
    assert {"cache.0.keys", "cache.0.values", "state.last"} <= set(tensors)
    assert meta["identity"] == "draft-a" and meta["caches"][0]["provider"] == "foretell.baseline/kv@1"


def test_flush_says_durable_only_once_an_attached_state_itself_is_on_disk(tmp_path, identity,
                                                                          codecs):
    tier = tier_over(tmp_path, identity, codecs)
    tier.store(range(12), [filled_kv(12), attachment(12, codecs)])
    tier.store(range(20), [filled_kv(20), attachment(20, codecs)])
    assert tier.flush(10).durable
    # The attached 12-token state's write is lost (as a dropped spill would lose it): the
    # 20-token entry can restore its target part, not its drafter state, so flush rewrites it.
    tier.ssd.remove(tier.ssd.find_exact(range(12), "").header.key)
    with tier._lock:
        tier._dirty.add(("", tuple(range(12))))
    assert tier.flush(10).durable
    assert tier.ssd.find_exact(range(12), "") is not None


def test_a_drafter_that_needs_its_state_prefers_its_exact_boundary(tmp_path, identity, codecs):
    tier = tier_over(tmp_path, identity, codecs)
    tier.store(range(12), [filled_kv(12), attachment(12, codecs, name="mtp/x")])
    tier.store(range(20), [filled_kv(20), attachment(20, codecs, name="mtp/x")])
    prompt = [*range(14), 99]  # the 20-token entry serves 14 tokens trimmed, the other 12 exactly
    longest = tier.lookup(prompt)
    assert longest.tokens == 14 and split_attachment(longest.caches)[1] is None
    assert tier.lookup(prompt, prefer="two-model/y").tokens == 14  # another drafter's state
    preferred = tier.lookup(prompt, prefer="mtp/x")
    assert preferred.tokens == 12 and split_attachment(preferred.caches)[1].identity == "mtp/x"
    # The same from disk in a fresh tier.
    assert tier.close(10).durable
    fresh = tier_over(tmp_path, identity, codecs).lookup(prompt, prefer="mtp/x")
    assert (fresh.tokens, fresh.tier) == (12, "ssd")
