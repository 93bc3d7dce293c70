"""A storage layout a third party installs, written to the documented contract
(``foretell.store.StorageLayout``) and nothing more (no file paths, no ``skipped``): the
cache tier stores and restores through it, and ``foretell cache ls|stats|verify|clear``
list, count, check and clear its entries."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from cachefill import filled_kv

from foretell.cache.codecs import snapshot_entry
from foretell.cli import main
from foretell.cli.cache_cmd import layouts
from foretell.tools import make_model_dir

#: A layout that keeps entries in this process's memory, per root and identity (as one
#: over a key-value service would keep them there): the contract's methods only.
DICT_LAYOUT = '''
import hashlib
import json
import time

import foretell
from foretell.store.entry import EntryHeader, LayerHeader

STORES = {}


class DictLayout:
    def __init__(self, root, config, *, identity):
        self.identity = identity
        self.io_failures = 0
        self._entries = STORES.setdefault((str(root), identity.directory), {})

    def key_for(self, tokens, namespace=""):
        return hashlib.sha256(json.dumps([namespace, list(tokens)]).encode()).hexdigest()[:32]

    def write(self, entry):
        self._entries[self.key_for(entry.tokens, entry.namespace)] = [entry, time.time()]
        return True

    def read(self, key):
        found = self._entries.get(key)
        if found is None:
            return None
        found[1] = time.time()
        return found[0]

    def scan(self):
        return self.headers()

    def headers(self):
        return sorted((EntryHeader(
            key=key, tokens=entry.tokens, namespace=entry.namespace,
            layers=tuple(LayerHeader(codec=la.codec, provider=la.provider, meta=dict(la.meta))
                         for la in entry.layers),
            nbytes=entry.tensor_bytes, last_used=used)
            for key, (entry, used) in self._entries.items()), key=lambda h: h.last_used)

    def remove(self, key):
        return self._entries.pop(key, None) is not None

    def collect(self):
        return 0

    def bytes(self):
        return sum(entry.tensor_bytes for entry, _used in self._entries.values())


@foretell.hookimpl
def foretell_register_storage_layouts(register):
    register("dict", "foretell_dictstore:DictLayout", summary="entries in memory")
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("third-party-layout") / "qwen3", "qwen3")


@pytest.fixture
def dict_layout(fake_distribution, model_dir, tmp_path, codecs):
    """The installed layout over ``tmp_path`` for the model, holding two entries."""
    fake_distribution("foretell-dictstore", entry_points={
        "foretell.plugins": {"dictstore": "foretell_dictstore"}},
        modules={"foretell_dictstore": DICT_LAYOUT})
    [layout] = layouts(argparse.Namespace(cache_dir=str(tmp_path), model=str(model_dir),
                                          kv_bits=None, layout="dict"))
    assert type(layout).__name__ == "DictLayout"
    for n in (6, 9):
        assert layout.write(snapshot_entry(list(range(n)), [filled_kv(n)], codecs))
    return layout


def cache_json(capsys, action, tmp_path, model_dir) -> tuple[int, dict]:
    code = main(["cache", action, "--cache-dir", str(tmp_path), "--model", str(model_dir),
                 "--layout", "dict", "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_cache_commands_list_count_verify_and_clear_a_third_party_layouts_entries(
        dict_layout, tmp_path, model_dir, capsys):
    code, listing = cache_json(capsys, "ls", tmp_path, model_dir)
    assert code == 0 and listing["skipped"] == []
    assert sorted(r["tokens"] for r in listing["entries"]) == [6, 9]
    assert {r["layout"] for r in listing["entries"]} == {"dict"}
    code, stats = cache_json(capsys, "stats", tmp_path, model_dir)
    assert code == 0 and stats["entries"] == 2 and stats["bytes"] == dict_layout.bytes()
    assert cache_json(capsys, "verify", tmp_path, model_dir) == (
        0, {"verified": 2, "bad": [], "skipped": []})
    code, cleared = cache_json(capsys, "clear", tmp_path, model_dir)
    assert code == 0 and (cleared["removed"], cleared["not_removed"]) == (2, 0)
    assert dict_layout.headers() == []


def test_entries_are_named_by_layout_and_key_where_a_layout_has_no_location(
        dict_layout, tmp_path, model_dir, capsys):
    from foretell.cli.cache_cmd import location

    key = dict_layout.headers()[0].key
    assert location(dict_layout, key) == f"dict:{key}"


def test_the_tier_stores_and_restores_through_a_third_party_layout(dict_layout, codecs):
    from foretell.cache.tier import CacheTier

    writer = CacheTier(codecs, layout=dict_layout)
    writer.store(range(12), [filled_kv(12)])
    assert writer.close(10).durable
    fresh = CacheTier(codecs, layout=type(dict_layout)(
        "unused", None, identity=dict_layout.identity))
    try:
        assert fresh.lookup([*range(12), 99]).tier is None  # another root: nothing there
    finally:
        fresh.close()
    again = CacheTier(codecs, layout=dict_layout)
    try:
        reuse = again.lookup([*range(12), 99])
        assert (reuse.tokens, reuse.tier) == (12, "ssd")
    finally:
        again.close()
