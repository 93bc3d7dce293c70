"""A codec a third party registers through ``foretell_register_cache_codecs`` is all it takes
for the cache tier to keep, persist and restore a cache class core has never seen: here a
recurrent state (a running sum, as a state-space layer keeps), which cannot roll back, beside
an ordinary KV cache, through both storage layouts. Without the plugin loaded, its entries
are never served."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cachefill import filled_kv

from foretell import hookimpl
from foretell.cache.codecs import load_codecs
from foretell.cache.tier import CacheTier
from foretell.plugin import Kind
from foretell.store.entry import StoreIdentity
from foretell.store.single_file import SingleFileLayout

PROVIDER = "foretell-toystate/running-sum@1"


class RunningSumCache:
    """A layer's recurrent state: the sum of every input so far. Exact only at the length
    it holds (a state cannot be rolled back)."""

    def __init__(self, width: int = 8):
        self.state = mx.zeros((1, width))
        self.offset = 0

    def update(self, inputs: mx.array) -> mx.array:
        self.state = self.state + inputs.sum(axis=1)
        self.offset += inputs.shape[1]
        return self.state

    def is_trimmable(self) -> bool:
        return False

    def stays_trimmable(self, n: int) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return self.state.nbytes


class RunningSumCodec:
    name = "running-sum"
    provider_id = PROVIDER

    def matches(self, cache: Any) -> bool:
        return type(cache) is RunningSumCache

    def snapshot(self, cache: RunningSumCache):
        return {"state": cache.state}, {"offset": cache.offset, "width": cache.state.shape[1]}

    def load(self, tensors, meta) -> RunningSumCache:
        cache = RunningSumCache(int(meta["width"]))
        cache.state, cache.offset = tensors["state"], int(meta["offset"])
        return cache

    def clone(self, cache: RunningSumCache) -> RunningSumCache:
        return self.load(*self.snapshot(cache))  # MLX arrays are values: sharing is safe

    def header_trimmable(self, meta) -> bool:
        return False

    def minimum_reusable_offset(self, meta) -> int:
        return int(meta["offset"])


class ToyStatePlugin:
    @hookimpl
    def foretell_register_cache_codecs(self, register):
        register("running-sum", f"{__name__}:RunningSumCodec", summary="a running-sum state")


def inputs(n: int, seed: int) -> mx.array:
    return mx.random.normal((1, n, 8), key=mx.random.key(seed))


def sequence(n: int) -> list[Any]:
    state = RunningSumCache()
    state.update(inputs(n, seed=n))
    return [filled_kv(n), state]


@pytest.fixture
def plugin_codecs(foretell_plugins):
    with foretell_plugins.temporary(ToyStatePlugin(), name="toy-state",
                                    distribution="foretell-toystate", version="0.1"):
        assert foretell_plugins.registry.get(Kind.CODEC, "running-sum").origin.plugin == \
            "toy-state"
        yield load_codecs(foretell_plugins.registry)


def identity_for(codecs) -> StoreIdentity:
    return StoreIdentity(model_fingerprint="0123456789abcdef", model_id="test/state",
                         tokenizer_hash="tok-aaaa",
                         codec_providers=[c.provider_id for c in codecs])


def layout_of(kind: str, root, codecs):
    if kind == "single-file":
        return SingleFileLayout(root, identity=identity_for(codecs))
    from foretell_blockstore.layout import BlockStoreConfig, BlockStoreLayout

    return BlockStoreLayout(root, BlockStoreConfig(block_tokens=4), identity=identity_for(codecs))


@pytest.mark.parametrize("kind", ["single-file", "blocks"])
def test_a_plugins_cache_class_is_stored_and_restored_by_a_fresh_tier(
        plugin_codecs, tmp_path, kind):
    original = sequence(12)
    first = CacheTier(plugin_codecs, layout=layout_of(kind, tmp_path, plugin_codecs))
    first.store(range(12), original)
    assert first.flush(10).durable
    first.close()

    fresh = CacheTier(plugin_codecs, layout=layout_of(kind, tmp_path, plugin_codecs))
    try:
        reuse = fresh.lookup([*range(12), 99])
        assert (reuse.tokens, reuse.tier) == (12, "ssd")
        restored = reuse.caches[1]
        assert type(restored) is RunningSumCache and restored.offset == 12
        np.testing.assert_array_equal(np.asarray(restored.state), np.asarray(original[1].state))
        more = inputs(3, seed=7)  # it continues as the original would
        np.testing.assert_array_equal(np.asarray(restored.update(more)),
                                      np.asarray(original[1].update(more)))
    finally:
        fresh.close()


@pytest.mark.parametrize("kind", ["single-file", "blocks"])
def test_a_state_that_cannot_roll_back_serves_its_exact_length_only(
        plugin_codecs, tmp_path, kind):
    tier = CacheTier(plugin_codecs, layout=layout_of(kind, tmp_path, plugin_codecs))
    try:
        tier.store(range(12), sequence(12))
        assert tier.flush(10).durable
        assert tier.lookup([*range(8), 50, 51]).tokens == 0  # would need 8 of 12 tokens
        assert tier.lookup([*range(12), 99]).tokens == 12
    finally:
        tier.close()


@pytest.mark.parametrize("kind", ["single-file", "blocks"])
def test_without_the_plugin_its_entries_are_never_served(
        plugin_codecs, codecs, tmp_path, kind):
    tier = CacheTier(plugin_codecs, layout=layout_of(kind, tmp_path, plugin_codecs))
    tier.store(range(12), sequence(12))
    assert tier.flush(10).durable
    tier.close()

    without = CacheTier(codecs, layout=layout_of(kind, tmp_path, codecs))
    try:
        assert without.lookup([*range(12), 99]).tokens == 0
        assert without.ssd.restores == 0
    finally:
        without.close()
    again = CacheTier(plugin_codecs, layout=layout_of(kind, tmp_path, plugin_codecs))
    try:  # skipped, not deleted: with the plugin back, it serves again
        assert again.lookup([*range(12), 99]).tokens == 12
    finally:
        again.close()


def test_the_cache_commands_say_why_such_entries_are_not_served(plugin_codecs, tmp_path, capsys):
    """Where the plugin is not installed (the CLI loads what is), the directory does not
    look empty for no reason: ls, stats and verify count the entries they pass over and
    name the missing codec provider; verify and clear delete none of them, verify fails
    nothing."""
    import json

    from foretell.cli import main as cli_main

    for kind in ("single-file", "blocks"):
        tier = CacheTier(plugin_codecs, layout=layout_of(kind, tmp_path, plugin_codecs))
        tier.store(range(12), sequence(12))
        assert tier.flush(10).durable
        tier.close()
    stored = sorted(str(p) for p in tmp_path.rglob("*.safetensors"))
    assert len(stored) == 2

    assert cli_main(["cache", "ls", "--cache-dir", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["entries"] == []
    assert [s["path"] for s in listed["skipped"]] == stored
    assert all(PROVIDER in s["reason"] and "not loaded" in s["reason"]
               for s in listed["skipped"])
    for action in ("stats", "verify"):
        assert cli_main(["cache", action, "--cache-dir", str(tmp_path), "--json"]) == 0
        assert [s["path"] for s in json.loads(capsys.readouterr().out)["skipped"]] == stored
    for action in ("ls", "stats", "verify", "clear"):
        assert cli_main(["cache", action, "--cache-dir", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert "2 entries kept but not served here" in out, action
        assert f"2 × codec provider '{PROVIDER}' is not loaded here" in out, action
    assert sorted(str(p) for p in tmp_path.rglob("*.safetensors")) == stored
