"""A cache location given as a URL selects the storage layout a plugin registered for its
scheme (``register(..., schemes=("memkv",))``), wherever a location is given: ``--cache-dir``,
``[cache] dir``, ``foretell.load(cache=...)``, ``CacheTier.for_engine`` and the ``foretell
cache`` commands; nothing on those paths treats the URL as a directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import foretell
from foretell.cli import main
from foretell.config import load_run_config
from foretell.errors import ConfigError, UnknownContribution
from foretell.plugin.loader import load_plugins
from foretell.tools import make_model_dir

#: A layout over an in-process "service": entries kept per URL and identity, with an option
#: of its own, listing the identities a URL holds (as foretell-redis does over Redis).
MEMKV_LAYOUT = '''
import hashlib
import json
import time

import attrs

import foretell
from foretell.store.entry import EntryHeader, LayerHeader

STORES = {}
OPENED = []


@attrs.frozen(kw_only=True)
class MemKVConfig:
    shards: int = attrs.field(default=1, metadata={"help": "how many shards"})


class MemKVLayout:
    def __init__(self, root, config, *, identity):
        if not isinstance(root, str) or not root.startswith("memkv://"):
            raise ValueError(f"not a memkv URL: {root!r}")
        self.root, self.config, self.identity = root, config, identity
        self.io_failures = 0
        self._entries = STORES.setdefault(root, {}).setdefault(identity, {})
        OPENED.append(self)

    @classmethod
    def stored_identities(cls, root, codec_providers):
        return [i for i, entries in STORES.get(root, {}).items() if entries]

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
    register("memkv", "foretell_memkv:MemKVLayout", config=MemKVConfig, schemes=("memkv",),
             summary="entries in this process's memory, at memkv:// URLs")
'''

URL = "memkv://cache-host:1234/0"


@pytest.fixture
def memkv(fake_distribution):
    """The memkv layout installed as a plugin; its module, to look into its stores."""
    import importlib

    fake_distribution("foretell-memkv", entry_points={
        "foretell.plugins": {"memkv": "foretell_memkv"}}, modules={"foretell_memkv": MEMKV_LAYOUT})
    return importlib.import_module("foretell_memkv")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("layout-urls") / "qwen3", "qwen3")


def test_a_url_selects_the_layout_registered_for_its_scheme_and_a_directory_none(memkv):
    registry = load_plugins().registry
    assert registry.layout_for(URL).name == "memkv"
    assert registry.layout_for("MemKV://h/0").name == "memkv"  # schemes are case-blind
    for directory in ("/var/cache/foretell", "relative/dir", Path("memkv://h"), "C://drive"):
        assert registry.layout_for(directory) is None


def test_a_url_no_installed_layout_serves_is_refused_naming_its_scheme(memkv):
    # The list names every installed layout's schemes (CI runs this with foretell-redis too).
    with pytest.raises(UnknownContribution, match=r"no storage layout stores at nosuch:// URLs "
                                                  r"\(installed layouts serve [^)]*memkv://"):
        load_plugins().registry.layout_for("nosuch://h/0")


def test_schemes_are_for_storage_layouts_and_must_be_url_schemes(foretell_plugins):
    class Drafter:
        @foretell.hookimpl
        def foretell_register_draft_providers(self, register):
            register("d", "m:f", schemes=("redis",))

    class BadScheme:
        @foretell.hookimpl
        def foretell_register_storage_layouts(self, register):
            register("l", "m:f", schemes="redis")  # a string, not a list of them

    drafter = foretell_plugins.register(Drafter(), "drafter")
    assert drafter.status == "failed" and "schemes= is for storage layouts only" in drafter.error
    bad = foretell_plugins.register(BadScheme(), "badscheme")
    assert bad.status == "failed" and "schemes must be a list of URL schemes" in bad.error


def test_a_toml_url_selects_its_layout_and_takes_that_layouts_options(memkv, tmp_path):
    registry = load_plugins().registry
    path = tmp_path / "run.toml"
    path.write_text(f'[cache]\ndir = "{URL}"\nshards = 3\n')
    cache = load_run_config(registry, path).cache
    assert (cache.dir, cache.layout, cache.layout_options.shards) == (URL, "memkv", 3)
    path.write_text(f'[cache]\ndir = "{URL}"\nlayout = "blocks"\n')
    with pytest.raises(ConfigError, match="'blocks' does not store at memkv://.*layout 'memkv'"):
        load_run_config(registry, path)
    path.write_text('[cache]\ndir = "nosuch://h/0"\n')
    with pytest.raises(ConfigError, match="dir: no storage layout stores at nosuch://"):
        load_run_config(registry, path)


def test_load_with_a_url_opens_a_tier_over_the_urls_layout_and_reuses_across_engines(
        memkv, model_dir):
    prompt = list(range(3, 40))
    first = foretell.load(model_dir, cache=URL)
    assert type(first.cache.ssd.layout).__name__ == "MemKVLayout"
    assert first.cache.ssd.layout.root == URL
    list(first.generate(prompt, max_tokens=3, ignore_eos=True))
    assert first.cache.close(10).durable
    second = foretell.load(model_dir, cache=URL)
    *_, stats = second.generate(prompt, max_tokens=3, ignore_eos=True)
    assert (stats.cached_from, stats.cached_tokens) == ("ssd", len(prompt) - 1)


def test_a_layout_named_for_a_url_it_does_not_store_at_is_refused(memkv, model_dir):
    from foretell.cache.tier import CacheTier

    engine = foretell.load(model_dir)
    with pytest.raises(ConfigError, match="'single-file' does not store at memkv://"):
        CacheTier.for_engine(engine, URL, layout="single-file")


def test_foretell_run_with_a_url_cache_dir_stores_there_and_a_second_run_reuses_it(
        memkv, model_dir, capsys):
    argv = ["run", "--model", str(model_dir), "--prompt", "one two three four five six seven",
            "--max-tokens", "3", "--json", "--cache-dir", URL]
    runs = []
    for _ in range(2):
        assert main(argv) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert runs[0]["cached_from"] is None and runs[1]["cached_from"] == "ssd"
    assert runs[1]["cached_tokens"] > 0
    assert memkv.OPENED[-1].root == URL and memkv.OPENED[-1].config.shards == 1


def test_cache_commands_list_count_verify_and_clear_what_a_url_holds(memkv, model_dir, capsys):
    import mlx.core as mx

    from foretell.cache.codecs import load_codecs, snapshot_entry
    from foretell.cache.tier import CacheTier

    engine = foretell.load(model_dir)
    tier = CacheTier.for_engine(engine, URL)
    caches = engine.make_caches()
    engine.model.forward(mx.array([list(range(9))]), caches)
    tier.ssd.write(snapshot_entry(range(9), caches, load_codecs(engine.registry)))

    def cache_json(action, *extra):
        code = main(["cache", action, "--cache-dir", URL, "--json", *extra])
        return code, json.loads(capsys.readouterr().out)

    code, listing = cache_json("ls")
    assert code == 0 and [(r["tokens"], r["layout"]) for r in listing["entries"]] == [
        (9, "memkv")]
    code, stats = cache_json("stats")
    assert (code, stats["cache_dir"], stats["entries"], stats["interrupted_writes"]) == (
        0, URL, 1, 0)
    assert cache_json("verify") == (0, {"verified": 1, "bad": [], "skipped": []})
    assert cache_json("ls", "--model", str(model_dir))[1]["entries"][0]["tokens"] == 9
    code, cleared = cache_json("clear")
    assert (code, cleared["removed"]) == (0, 1)
    assert cache_json("ls")[1]["entries"] == []
    assert main(["cache", "ls", "--cache-dir", URL, "--model", str(model_dir), "--layout",
                 "blocks"]) == 1
    assert "--layout blocks does not store at memkv://" in capsys.readouterr().err
