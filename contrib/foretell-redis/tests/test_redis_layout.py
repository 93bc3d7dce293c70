"""The ``redis`` layout against a real server: the storage contract; damaged, truncated and
foreign values never served; shared prefixes stored once; a lookup in one round trip that
finds what another process stored; collection that frees only what no manifest lists; the
tier's cap under the server's ``maxmemory``, and a full server refusing writes."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("redis", reason="the redis client is not installed (pip install "
                                    "./contrib/foretell-redis brings it)")

import attrs  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from foretell.cache.codecs import StandardKVCodec, snapshot_entry  # noqa: E402
from foretell.cache.tier import CacheTier  # noqa: E402
from foretell.model import KVCache  # noqa: E402
from foretell.plugin.testing import check_storage_layout  # noqa: E402
from foretell.store.entry import StoreIdentity  # noqa: E402
from foretell_redis.layout import RedisConfig, RedisLayout  # noqa: E402

BLOCK = 8
CODECS = [StandardKVCodec()]
IDENTITY = StoreIdentity(model_fingerprint="0123456789abcdef", model_id="test/tiny",
                         tokenizer_hash="tok-aaaa",
                         codec_providers=[c.provider_id for c in CODECS])


def layout_at(url, identity=IDENTITY, **config):
    return RedisLayout(url, RedisConfig(**{"block_tokens": BLOCK, **config}),
                       identity=identity)


def filled(n: int, seed: int = 0) -> KVCache:
    """A cache after ``n`` tokens; caches of one seed agree on their common prefix."""
    cache = KVCache()
    keys = mx.random.normal((1, 4, n, 64), key=mx.random.key(seed))
    cache.update_and_fetch(keys, -keys)
    return cache


def entry(n: int, seed: int = 0, namespace: str = ""):
    return snapshot_entry(range(n), [filled(n, seed)], CODECS, namespace)


def flip_a_byte(client, key: str, at: int = -1) -> None:
    value = bytearray(client.get(key))
    value[at] ^= 0xFF
    client.set(key, bytes(value))


def block_keys(client) -> list[bytes]:
    return sorted(client.scan_iter(match="foretell:*:b:*"))


def test_the_layout_keeps_the_storage_contract(redis_url, shared_server):
    client = shared_server.client()

    def damage(layout, key):
        last = layout._manifests[key][2].blocks[-1]
        flip_a_byte(client, layout._block_key(last.id))

    check_storage_layout(lambda identity: layout_at(redis_url, identity), damage=damage)


@pytest.mark.parametrize("fault", ["flipped", "truncated", "missing", "foreign bytes"])
def test_a_damaged_block_is_never_served_and_its_entry_is_dropped(
        redis_url, shared_server, fault, caplog):
    client = shared_server.client()
    layout = layout_at(redis_url)
    assert layout.write(entry(20))
    key = layout.key_for(range(20))
    block = layout._block_key(layout._manifests[key][2].blocks[1].id)
    if fault == "flipped":
        flip_a_byte(client, block, at=200)
    elif fault == "truncated":
        client.set(block, client.get(block)[:-7])
    elif fault == "missing":
        client.delete(block)
    else:
        client.set(block, b"\0" * len(client.get(block)))
    reader = layout_at(redis_url)  # another process: it never saw the entry's bytes
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        assert reader.read(key) is None
    assert key in reader.dropped and "dropped" in caplog.text
    assert reader.scan() == [] and layout_at(redis_url).read(key) is None
    if fault != "missing":  # a damaged block is deleted: later writes would reuse it
        assert client.get(block) is None


@pytest.mark.parametrize("fault", ["truncated", "garbage", "renamed"])
def test_a_damaged_manifest_is_never_served(redis_url, shared_server, fault):
    client = shared_server.client()
    layout = layout_at(redis_url)
    for n in (12, 20):
        assert layout.write(entry(n))
    key, other = layout.key_for(range(12)), layout.key_for(range(20))
    manifest = layout._manifest_key(key)
    if fault == "truncated":
        client.set(manifest, client.get(manifest)[:-5])
    elif fault == "garbage":
        client.set(manifest, b"not a manifest at all")
    else:  # another prompt's manifest under this key: sound bytes, wrong place
        client.set(manifest, client.get(layout._manifest_key(other)))
    reader = layout_at(redis_url)
    assert [h.key for h in reader.scan()] == [other]
    assert reader.read(key) is None and key in reader.dropped
    assert reader.read(other) is not None


def test_another_models_entries_are_neither_served_nor_deleted(redis_url, shared_server):
    theirs = attrs.evolve(IDENTITY, tokenizer_hash="tok-bbbb")
    writer = layout_at(redis_url, theirs)
    assert writer.write(entry(20))
    key = writer.key_for(range(20))
    ours = layout_at(redis_url)
    # Their manifest placed where ours would be for the same prompt: foreign, not damaged.
    client = shared_server.client()
    client.set(ours._manifest_key(ours.key_for(range(20))), client.get(writer._manifest_key(key)))
    client.zadd(f"{ours._base}:entries", {ours.key_for(range(20)): 1.0})
    assert ours.scan() == [] and ours.read(ours.key_for(range(20))) is None
    assert any("tokenizer_hash" in why for why in ours.skipped.values())
    ours.collect()
    assert layout_at(redis_url, theirs).read(key) is not None  # their blocks kept too


def test_entries_sharing_a_prefix_share_its_blocks(redis_url, shared_server):
    layout = layout_at(redis_url)
    for namespace in ("", "a", "b"):  # three conversations over one 24-token prefix
        assert layout.write(entry(24, namespace=namespace))
    assert len(block_keys(shared_server.client())) == 3  # 24 tokens in blocks of 8, once
    logical = sum(h.nbytes for h in layout.headers())
    assert layout.bytes() < logical / 2.5
    assert layout.bytes_reused > 0


def test_a_lookup_finds_what_another_process_stored_in_one_round_trip(
        redis_url, monkeypatch):
    import redis.connection

    reader = layout_at(redis_url)
    assert reader.scan() == []  # opened before the other process stored anything
    writer = layout_at(redis_url)
    assert writer.write(entry(40))
    sent = []
    real = redis.connection.Connection.send_packed_command
    monkeypatch.setattr(redis.connection.Connection, "send_packed_command",
                        lambda self, *a, **k: (sent.append(1), real(self, *a, **k))[1])
    prompt = [*range(40), 99, 98]
    [found] = reader.prefixes(prompt, "", beyond=0)
    assert (found.tokens, len(sent)) == (tuple(range(40)), 1)
    restored = reader.read(found.key)
    assert len(sent) == 2  # the manifest and every block in one pipeline
    np.testing.assert_array_equal(np.asarray(restored.layers[0].tensors["keys"]),
                                  np.asarray(entry(40).layers[0].tensors["keys"]))


def test_a_tier_serves_what_another_process_stored_after_it_opened(redis_url):
    first = CacheTier(CODECS, layout=layout_at(redis_url))
    try:
        assert first.lookup([*range(30), 7]).tier is None
        other = CacheTier(CODECS, layout=layout_at(redis_url))
        other.store(range(30), [filled(30)])
        assert other.close(10).durable
        reuse = first.lookup([*range(30), 7])
        assert (reuse.tier, reuse.tokens) == ("ssd", 30)
    finally:
        first.close()


def test_collect_frees_only_blocks_no_manifest_lists(redis_url, shared_server):
    client = shared_server.client()
    patient, eager = layout_at(redis_url), layout_at(redis_url, collect_grace_s=0)
    assert eager.write(entry(24, seed=1)) and eager.write(entry(16, seed=2))
    assert len(block_keys(client)) == 5
    eager.remove(eager.key_for(range(24)))
    assert patient.collect() > 0  # a removal frees its blocks at once...
    assert len(block_keys(client)) == 2
    assert eager.read(eager.key_for(range(16))) is not None
    # ...but a block a writer stored and has not published yet waits out the grace
    writer = layout_at(redis_url)
    writer._upload(*_blocks_of(writer, entry(8, seed=3)))
    assert len(block_keys(client)) == 3
    assert patient.collect() == 0 and len(block_keys(client)) == 3


def _blocks_of(layout, e):
    """(ids, made) of ``e``'s blocks, as ``write`` makes them, marked loose as a writer's."""
    from foretell_blockstore import manifest as mf

    made, hosts = {}, mf.host_views(e)
    for group in mf.plan_groups(e):
        for begin, end in group.spans(BLOCK):
            pieces = mf.block_pieces(hosts, group, begin, end)
            header = mf.block_header(group, begin, end)
            made[mf.block_ref(header, pieces).id] = (header, pieces)
    layout._scripts["TOUCH"](keys=[f"{layout._base}:loose",
                                   *(layout._block_key(i) for i in made)], args=list(made))
    return list(made), made


def test_the_tiers_cap_stays_under_the_servers_maxmemory(redis_url, shared_server):
    client = shared_server.client()
    client.config_set("maxmemory", 10 << 20)
    try:
        tier = CacheTier(CODECS, layout=layout_at(redis_url, memory_share=0.5),
                         ssd_bytes=1 << 30)
        assert tier.ssd.cap() == 5 << 20 and tier.stats()["ssd"]["max_bytes"] == 5 << 20
        tier.close()
    finally:
        client.config_set("maxmemory", 0)
    assert CacheTier(CODECS, layout=layout_at(redis_url), ssd_bytes=1 << 30).ssd.cap() == 1 << 30


def test_a_full_server_refuses_writes_with_one_warning_and_still_serves(
        redis_url, shared_server, caplog):
    client = shared_server.client()
    layout = layout_at(redis_url)
    assert layout.write(entry(16))
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    try:
        with caplog.at_level(logging.WARNING, logger="foretell.store"):
            assert [layout.write(entry(24, seed=s)) for s in (5, 6, 7)] == [False] * 3
            assert layout.read(layout.key_for(range(16))) is not None  # reads still work
            assert layout.write(entry(32, seed=8)) is False
    finally:
        client.config_set("maxmemory", 0)
    full = [r for r in caplog.records if r.levelno == logging.WARNING and "full" in r.message]
    assert len(full) == 1 and layout.io_failures == 4
    assert layout.write(entry(24, seed=5))  # room again: stored


def test_a_restore_lands_in_the_reserve_filled_before_it(redis_url):
    layout = layout_at(redis_url)
    assert layout.write(entry(24))
    reader = layout_at(redis_url)
    reader.replenish()
    assert reader.reserve.held() > 0 and not reader.reserve.used_since_fill()
    restored = reader.read(reader.key_for(range(24)))
    assert reader.reserve.used_since_fill()  # its buffers came from the reserve
    np.testing.assert_array_equal(np.asarray(restored.layers[0].tensors["values"]),
                                  np.asarray(entry(24).layers[0].tensors["values"]))
