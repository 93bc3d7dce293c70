"""Discovery through entry points, isolation of broken plugins, conflicts, switches."""

import json

import pytest

from foretell.cli import main
from foretell.config import load_run_config
from foretell.errors import ConfigError, PluginError, UnknownContribution
from foretell.plugin import Kind, PluginSwitches, load_plugins

GOOD = """
import attrs
from foretell import hookimpl

@attrs.frozen(kw_only=True)
class EchoOptions:
    depth: int = 2

@hookimpl
def foretell_register_draft_providers(register):
    register("echo", "{module}:EchoOptions", config=EchoOptions, summary="echoes")
"""

RAISES_IN_HOOK = """
from foretell import hookimpl

@hookimpl
def foretell_register_draft_providers(register):
    register("fine-before-raise", "x:y")
    raise RuntimeError("boom inside registration")
"""


def _plugin(fake_distribution, dist, ep_name, module, source):
    fake_distribution(
        dist,
        "1.0",
        entry_points={"foretell.plugins": {ep_name: module}},
        modules={module: source.replace("{module}", module)},
    )


def _chain(exc):
    """Every exception reachable through causes and exception groups."""
    seen, todo = [], [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return seen


def _listing(capsys, *args):
    code = main(["plugins", "--json", *args])
    out = capsys.readouterr().out
    return code, {row["name"]: row for row in json.loads(out)["plugins"]}, json.loads(out)


def test_third_party_plugin_is_discovered_and_its_contribution_usable(fake_distribution):
    _plugin(fake_distribution, "foretell-echo", "echo", "foretell_echo", GOOD)
    plugins = load_plugins()
    item = plugins.registry.get(Kind.DRAFT, "echo")
    assert item.origin.distribution == "foretell-echo" and not item.origin.builtin
    config = load_run_config(plugins.registry, overrides={"draft": ({"kind": "echo", "depth": 5}, "--draft")})
    assert config.draft.kind == "echo" and config.draft.options.depth == 5


def test_broken_plugins_are_listed_as_failed_and_the_rest_keep_working(fake_distribution, capsys):
    _plugin(fake_distribution, "foretell-good", "good", "foretell_good", GOOD)
    _plugin(fake_distribution, "foretell-noimport", "noimport", "foretell_noimport", "import not_a_real_module_xyz\n")
    _plugin(fake_distribution, "foretell-raises", "raises", "foretell_raises", RAISES_IN_HOOK)
    code, rows, _ = _listing(capsys)
    assert code == 0
    assert rows["good"]["status"] == "loaded"
    assert rows["noimport"]["status"] == "failed"
    assert "No module named 'not_a_real_module_xyz'" in rows["noimport"]["error"]
    assert rows["noimport"]["distribution"] == "foretell-noimport" and rows["noimport"]["version"] == "1.0"
    assert rows["raises"]["status"] == "failed"
    assert "RuntimeError: boom inside registration" in rows["raises"]["error"]
    # a plugin that raises contributes nothing, not even what it registered before raising
    assert rows["raises"]["contributes"] == []
    assert rows["baseline"]["status"] == "loaded"


def test_text_listing_shows_failures_with_reasons(fake_distribution, capsys):
    _plugin(fake_distribution, "foretell-raises", "raises", "foretell_raises", RAISES_IN_HOOK)
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "raises  [third-party]  foretell-raises 1.0  FAILED" in out
    assert "error: a registration hook raised: RuntimeError: boom inside registration" in out


def test_selecting_a_contribution_of_a_failed_plugin_fails_with_its_original_error(fake_distribution):
    _plugin(fake_distribution, "foretell-raises", "raises", "foretell_raises", RAISES_IN_HOOK)
    registry = load_plugins().registry
    with pytest.raises(ConfigError) as info:
        load_run_config(registry, overrides={"draft": ({"kind": "fine-before-raise"}, "--draft")})
    message = str(info.value)
    assert "plugin 'raises' failed to load" in message and "boom inside registration" in message
    assert any(isinstance(e, RuntimeError) for e in _chain(info.value))


def test_strict_mode_turns_a_load_failure_into_an_error(fake_distribution):
    _plugin(fake_distribution, "foretell-noimport", "noimport", "foretell_noimport", "import not_a_real_module_xyz\n")
    with pytest.raises(PluginError, match=r"(?s)strict plugin loading failed:.*plugin 'noimport': import of 'foretell_noimport' failed"):
        load_plugins(switches=PluginSwitches(strict=True))


def test_strict_mode_from_the_environment(fake_distribution, monkeypatch, capsys):
    _plugin(fake_distribution, "foretell-noimport", "noimport", "foretell_noimport", "import not_a_real_module_xyz\n")
    monkeypatch.setenv("FORETELL_STRICT_PLUGINS", "1")
    assert main(["plugins"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("foretell: error: strict plugin loading failed")


def test_a_name_claimed_twice_stays_with_the_first_and_disables_the_newcomer(
    fake_distribution, capsys, caplog
):
    _plugin(fake_distribution, "foretell-echo-a", "echo-a", "foretell_echo_a", GOOD)
    _plugin(fake_distribution, "foretell-echo-b", "echo-b", "foretell_echo_b", GOOD)
    registry = load_plugins().registry
    assert registry.get(Kind.DRAFT, "echo").origin.plugin == "echo-a"
    message = (
        "draft:echo is contributed by both plugin 'echo-a' (foretell-echo-a 1.0) and plugin "
        "'echo-b' (foretell-echo-b 1.0); plugin 'echo-b', loaded later, is disabled and "
        "'echo-a' keeps the name. To use 'echo-b' instead, disable 'echo-a' with "
        "FORETELL_DISABLE_PLUGINS=echo-a; FORETELL_DISABLE_PLUGINS=echo-b silences this."
    )
    assert [r.getMessage() for r in caplog.records if r.name == "foretell.plugin"] == [
        f"plugin 'echo-b' is disabled: {message}"
    ]
    code, rows, listing = _listing(capsys)
    assert code == 0 and listing["conflicts"] == [message]
    assert rows["echo-a"]["status"] == "loaded"
    assert rows["echo-b"]["status"] == "disabled" and rows["echo-b"]["error"] == message
    assert rows["echo-b"]["contributes"] == []
    main(["plugins"])
    assert "echo-b  [third-party]  foretell-echo-b 1.0  DISABLED" in capsys.readouterr().out


def test_a_plugin_disabled_by_a_clash_takes_none_of_its_names(fake_distribution):
    # Half a plugin could pair its drafter with an architecture that is not its own.
    two_names = GOOD + """
@hookimpl
def foretell_register_cache_codecs(register):
    register("kv", "x.y:Codec")
"""
    _plugin(fake_distribution, "foretell-twice", "twice", "foretell_twice", two_names)
    plugins = load_plugins()
    assert plugins.registry.get(Kind.CODEC, "kv").origin.plugin == "baseline"
    assert "echo" not in plugins.registry.names(Kind.DRAFT)
    assert not plugins.pm.has_plugin("twice")
    with pytest.raises(UnknownContribution, match=r"disabled plugins, which may provide it: twice"):
        plugins.registry.get(Kind.DRAFT, "echo")


def test_a_plugin_reregistering_qwen3_leaves_the_demo_running(fake_distribution, capsys, caplog):
    # The newcomer's factory does not exist: were it chosen, the run would fail to load.
    shadow = """
from foretell import hookimpl

@hookimpl
def foretell_register_architectures(register):
    register("qwen3", "no_such_module:Model")
"""
    _plugin(fake_distribution, "foretell-shadow", "shadow", "foretell_shadow", shadow)
    argv = ["run", "--prompt", "def f(x):", "--max-tokens", "2", "--draft", "none", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["generated_tokens"] == 2
    warned = [r.getMessage() for r in caplog.records if r.name == "foretell.plugin"]
    assert len(warned) == 1 and warned[0].startswith("plugin 'shadow' is disabled: ")
    assert "architecture:qwen3" in warned[0] and "plugin 'qwen' (foretell " in warned[0]
    assert "registers with replaces=True" in warned[0]


def test_strict_mode_fails_on_a_clash(fake_distribution):
    _plugin(fake_distribution, "foretell-echo-a", "echo-a", "foretell_echo_a", GOOD)
    _plugin(fake_distribution, "foretell-echo-b", "echo-b", "foretell_echo_b", GOOD)
    with pytest.raises(PluginError, match=r"(?s)strict plugin loading failed:.*draft:echo .*'echo-b'"):
        load_plugins(switches=PluginSwitches(strict=True))


def test_a_plugin_registering_one_name_twice_fails(foretell_plugins):
    from foretell import hookimpl

    class Twice:
        @hookimpl
        def foretell_register_draft_providers(self, register):
            register("echo", "x.y:A")
            register("echo", "x.y:B")

    record = foretell_plugins.register(Twice(), "twice")
    assert record.status == "failed" and "registers draft:echo more than once" in record.error
    assert "echo" not in foretell_plugins.registry.names(Kind.DRAFT)


def test_disabling_one_side_resolves_a_conflict(fake_distribution, monkeypatch):
    _plugin(fake_distribution, "foretell-echo-a", "echo-a", "foretell_echo_a", GOOD)
    _plugin(fake_distribution, "foretell-echo-b", "echo-b", "foretell_echo_b", GOOD)
    monkeypatch.setenv("FORETELL_DISABLE_PLUGINS", "echo-a")  # the way to choose the newcomer
    plugins = load_plugins()
    assert plugins.registry.get(Kind.DRAFT, "echo").origin.plugin == "echo-b"
    assert not plugins.registry.conflicts


def test_a_third_party_may_replace_a_built_in_only_when_it_says_so(fake_distribution, capsys):
    replacing = """
from foretell import hookimpl

@hookimpl
def foretell_register_cache_codecs(register):
    register("kv", "my_kv:Codec", replaces=True, summary="faster kv")
"""
    _plugin(fake_distribution, "foretell-mykv", "mykv", "foretell_mykv", replacing)
    assert load_plugins().registry.get(Kind.CODEC, "kv").origin.plugin == "mykv"
    _, rows, _ = _listing(capsys)
    assert rows["mykv"]["contributes"][0]["replaces"] == "baseline"
    assert any(c.get("replaced_by") == "mykv" for c in rows["baseline"]["contributes"])


def test_replacing_without_saying_so_leaves_the_built_in_in_place(fake_distribution):
    silent = """
from foretell import hookimpl

@hookimpl
def foretell_register_cache_codecs(register):
    register("kv", "my_kv:Codec")
"""
    _plugin(fake_distribution, "foretell-mykv", "mykv", "foretell_mykv", silent)
    plugins = load_plugins()
    assert plugins.registry.get(Kind.CODEC, "kv").origin.plugin == "baseline"
    (conflict,) = plugins.registry.conflicts.values()
    assert conflict.message().startswith(
        "codec:kv is contributed by both plugin 'baseline' (foretell "
    )
    assert "plugin 'mykv', loaded later, is disabled" in conflict.message()


def test_block_list_disables_by_entry_point_name(fake_distribution, monkeypatch, capsys):
    _plugin(fake_distribution, "foretell-good", "good", "foretell_good", GOOD)
    monkeypatch.setenv("FORETELL_DISABLE_PLUGINS", "good, other")
    _, rows, _ = _listing(capsys)
    assert rows["good"]["status"] == "disabled" and rows["good"]["contributes"] == []


def test_allow_list_loads_only_the_named_plugins(fake_distribution, monkeypatch, capsys):
    _plugin(fake_distribution, "foretell-good", "good", "foretell_good", GOOD)
    _plugin(fake_distribution, "foretell-echo-b", "echo-b", "foretell_echo_b", GOOD)
    monkeypatch.setenv("FORETELL_LOAD_PLUGINS", "good")
    _, rows, _ = _listing(capsys)
    assert rows["good"]["status"] == "loaded"
    assert rows["echo-b"]["status"] == "disabled"
    assert rows["baseline"]["status"] == "loaded"  # core's own plugins are not entry points


def test_empty_allow_list_loads_no_entry_points(fake_distribution, monkeypatch, capsys):
    _plugin(fake_distribution, "foretell-good", "good", "foretell_good", GOOD)
    monkeypatch.setenv("FORETELL_LOAD_PLUGINS", "")
    _, rows, _ = _listing(capsys)
    assert {name for name, row in rows.items() if row["status"] == "loaded"} == {"baseline"}


def test_a_plugin_needing_a_newer_api_is_refused_naming_both_versions(fake_distribution, capsys):
    _plugin(fake_distribution, "foretell-future", "future", "foretell_future", "FORETELL_PLUGIN_API = 99\n" + GOOD)
    _, rows, _ = _listing(capsys)
    assert rows["future"]["status"] == "failed"
    assert "needs plugin API 99, this foretell provides 2" in rows["future"]["error"]


def test_a_contribution_needing_a_newer_api_is_refused(fake_distribution, capsys):
    future = GOOD.replace('summary="echoes"', 'summary="echoes", min_api=7')
    _plugin(fake_distribution, "foretell-future", "future", "foretell_future", future)
    _, rows, _ = _listing(capsys)
    assert "needs plugin API 7, this foretell provides 2" in rows["future"]["error"]


def test_the_same_entry_point_name_from_two_distributions_names_both(fake_distribution, capsys):
    _plugin(fake_distribution, "foretell-one", "same", "foretell_one", GOOD)
    _plugin(fake_distribution, "foretell-two", "same", "foretell_two", GOOD)
    code, _, listing = _listing(capsys)
    failed = [r for r in listing["plugins"] if r["name"] == "same" and r["status"] == "failed"]
    assert code == 0 and len(failed) == 1
    assert "already used by distribution foretell-" in failed[0]["error"]


def test_plugin_hook_with_unknown_arguments_fails_validation(foretell_plugins):
    from foretell import hookimpl

    class Wrong:
        @hookimpl
        def foretell_register_cache_codecs(self, register, extra_argument):
            pass

    record = foretell_plugins.register(Wrong(), "wrong")
    assert record.status == "failed" and "invalid hook implementations" in record.error


def _blocking_from(name, monkeypatch):
    """Disable ``name`` and every entry point loaded after it, so ``name`` is the last plugin
    the loader records, whatever else this environment has installed."""
    from foretell.plugin.loader import _entry_points

    names = [ep.name for ep in _entry_points()]
    monkeypatch.setenv("FORETELL_DISABLE_PLUGINS", ",".join(names[names.index(name):]))


def test_the_last_plugin_loaded_being_disabled_is_reported_as_disabled(monkeypatch, capsys):
    _blocking_from("two-model", monkeypatch)
    assert main(["run", "x", "--draft", "two-model"]) == 1
    err = capsys.readouterr().err
    assert "draft 'two-model': plugin 'two-model' is installed but disabled: " in err
    assert "FORETELL_DISABLE_PLUGINS names it" in err and "not installed" not in err


def test_a_plugin_left_out_of_the_allow_list_says_so(fake_distribution, monkeypatch):
    _plugin(fake_distribution, "foretell-good", "good", "foretell_good", GOOD)
    monkeypatch.setenv("FORETELL_LOAD_PLUGINS", "")
    with pytest.raises(UnknownContribution) as info:
        load_plugins().registry.get(Kind.DRAFT, "good")
    assert str(info.value) == (
        "draft 'good': plugin 'good' is installed but disabled: FORETELL_LOAD_PLUGINS does not "
        "name it; add it to that list to use it"
    )


def test_the_ngram_fixture_installs_the_contrib_drafter_beside_the_environment(ngram_installed):
    import subprocess
    import sys

    assert sorted(p.name for p in ngram_installed.glob("foretell_ngram*")) == [
        "foretell_ngram", "foretell_ngram-0.1.0.dist-info"
    ]
    assert not ngram_installed.is_relative_to(sys.prefix)  # the test environment is untouched
    (record,) = [r for r in load_plugins().records if r.name == "ngram"]
    assert (record.status, record.kind, record.distribution) == ("loaded", "third-party", "foretell-ngram")
    listing = subprocess.run([sys.executable, "-m", "foretell", "plugins", "--json"],
                             check=True, capture_output=True, text=True, timeout=120).stdout
    rows = {row["name"]: row for row in json.loads(listing)["plugins"]}
    assert rows["ngram"]["status"] == "loaded"
    assert rows["ngram"]["contributes"][0]["name"] == "ngram"
