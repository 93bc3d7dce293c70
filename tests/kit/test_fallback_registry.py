"""A fallback architecture serves a model_type only where no plugin implements it natively,
whatever the load order, and `foretell plugins` says which plugin serves each model_type."""

from __future__ import annotations

import types

import pytest

from foretell import hookimpl
from foretell.cli.plugins_cmd import describe, render
from foretell.errors import PluginError
from foretell.plugin import Kind


def _plugin(names, *, fallback):
    @hookimpl
    def foretell_register_architectures(register):
        for name in names:
            register(name, "builtins:dict", fallback=fallback)

    return types.SimpleNamespace(foretell_register_architectures=foretell_register_architectures)


@pytest.mark.parametrize("fallback_first", [True, False])
def test_a_native_architecture_wins_over_a_fallback_in_either_order(foretell_plugins,
                                                                     fallback_first):
    zoo, native = _plugin(["llama", "mamba"], fallback=True), _plugin(["llama"], fallback=False)
    order = [("zoo", zoo), ("native", native)]
    for name, plugin in (order if fallback_first else order[::-1]):
        record = foretell_plugins.register(plugin, name)
        assert record.status == "loaded", record.error
    registry = foretell_plugins.registry
    assert registry.get(Kind.ARCHITECTURE, "llama").origin.plugin == "native"
    assert registry.get(Kind.ARCHITECTURE, "mamba").origin.plugin == "zoo"
    assert not registry.conflicts
    (shadow,) = registry.shadowed
    assert (shadow.native.origin.plugin, shadow.fallback.origin.plugin) == ("native", "zoo")


def test_two_fallbacks_of_one_name_conflict_like_any_two_plugins(foretell_plugins):
    foretell_plugins.register(_plugin(["llama"], fallback=True), "zoo-a")
    second = foretell_plugins.register(_plugin(["llama"], fallback=True), "zoo-b")
    assert second.status == "disabled"
    assert foretell_plugins.registry.get(Kind.ARCHITECTURE, "llama").origin.plugin == "zoo-a"


def test_a_fallback_cannot_also_replace_a_built_in(foretell_plugins):
    @hookimpl
    def foretell_register_architectures(register):
        register("qwen3", "builtins:dict", fallback=True, replaces=True)

    plugin = types.SimpleNamespace(foretell_register_architectures=foretell_register_architectures)
    record = foretell_plugins.register(plugin, "both")
    assert record.status == "failed"
    assert "fallback" in record.error and isinstance(record.exception, PluginError)


def test_foretell_plugins_shows_which_plugin_serves_each_model_type(foretell_plugins):
    foretell_plugins.register(_plugin(["llama", "mamba"], fallback=True), "zoo")
    foretell_plugins.register(_plugin(["llama"], fallback=False), "native")
    listing = describe(foretell_plugins)
    assert listing["model_types"]["llama"] == {"plugin": "native", "fallback": False}
    assert listing["model_types"]["mamba"] == {"plugin": "zoo", "fallback": True}
    zoo = next(r for r in listing["plugins"] if r["name"] == "zoo")
    llama = next(c for c in zoo["contributes"] if c["name"] == "llama")
    assert llama["served_by"] == "native"
    text = render(listing)
    assert "architecture:llama  (fallback; 'native' serves it natively)" in text
    assert "    native: llama" in text and "    zoo: mamba" in text
