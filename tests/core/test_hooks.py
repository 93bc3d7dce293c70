"""One test per hook spec (``test_hook_<name>``), plus the contract meta-tests."""

import re
from pathlib import Path

import attrs
import pytest

from foretell import hookimpl
from foretell.errors import PluginError
from foretell.plugin import Kind, hookspecs
from foretell.plugin.docgen import hook_specs, render

ROOT = Path(__file__).resolve().parents[2]


@attrs.frozen(kw_only=True)
class EchoOptions:
    depth: int = 2


class RegistersOneOfEach:
    @hookimpl
    def foretell_register_architectures(self, register):
        register("toy-arch", "toy.arch:build", summary="a toy architecture")

    @hookimpl
    def foretell_register_draft_providers(self, register):
        register("toy-draft", "toy.draft:Provider", config=EchoOptions, summary="a toy drafter")

    @hookimpl
    def foretell_register_cache_codecs(self, register):
        register("toy-codec", "toy.codec:Codec")

    @hookimpl
    def foretell_register_storage_layouts(self, register):
        register("toy-layout", "toy.layout:Layout", config=EchoOptions)


def _registered(foretell_plugins, kind, name):
    with foretell_plugins.temporary(RegistersOneOfEach(), name="toy", distribution="foretell-toy", version="1.2"):
        item = foretell_plugins.registry.get(kind, name)
    return item


def test_hook_foretell_register_architectures(foretell_plugins):
    item = _registered(foretell_plugins, Kind.ARCHITECTURE, "toy-arch")
    assert (item.factory, item.summary) == ("toy.arch:build", "a toy architecture")
    assert (item.origin.plugin, item.origin.distribution, item.origin.version) == ("toy", "foretell-toy", "1.2")


def test_hook_foretell_register_draft_providers(foretell_plugins):
    item = _registered(foretell_plugins, Kind.DRAFT, "toy-draft")
    assert item.config is EchoOptions and item.label == "draft:toy-draft"


def test_hook_foretell_register_cache_codecs(foretell_plugins):
    assert _registered(foretell_plugins, Kind.CODEC, "toy-codec").factory == "toy.codec:Codec"
    # core's own baseline codecs come through the same hook
    assert {"kv", "rotating-kv"} <= set(foretell_plugins.registry.names(Kind.CODEC))


def test_hook_foretell_register_storage_layouts(foretell_plugins):
    assert _registered(foretell_plugins, Kind.LAYOUT, "toy-layout").config is EchoOptions
    assert "single-file" in foretell_plugins.registry.names(Kind.LAYOUT)


def test_temporary_registration_is_undone(foretell_plugins):
    _registered(foretell_plugins, Kind.CODEC, "toy-codec")
    assert "toy-codec" not in foretell_plugins.registry.names(Kind.CODEC)
    assert not foretell_plugins.pm.has_plugin("toy")


def test_register_rejects_a_factory_that_is_not_module_attr(foretell_plugins):
    class Bad:
        @hookimpl
        def foretell_register_cache_codecs(self, register):
            register("bad", lambda: None)

    record = foretell_plugins.register(Bad(), "bad")
    assert record.status == "failed"
    assert "factory must be a 'module:attr' string" in record.error


def test_factory_import_errors_name_the_plugin(foretell_plugins):
    item = _registered(foretell_plugins, Kind.ARCHITECTURE, "toy-arch")
    with pytest.raises(PluginError, match=r"architecture:toy-arch from plugin 'toy' \(foretell-toy 1.2\)"):
        item.load()


# -- the contract: every spec documented, in the reference, tested, reached via the facade --


@pytest.mark.parametrize("spec", hook_specs(), ids=lambda f: f.__name__)
def test_every_spec_is_documented(spec):
    doc = spec.__doc__ or ""
    assert "Called" in doc, f"{spec.__name__}: say when it is called"
    assert ":param" in doc and ":returns:" in doc, f"{spec.__name__}: document params and return"


def test_hook_reference_is_generated_from_the_specs():
    committed = (ROOT / "docs" / "reference" / "hooks.md").read_text(encoding="utf-8")
    assert committed == render(), "run `python -m foretell.plugin.docgen` and commit the result"


def test_every_spec_has_a_test():
    sources = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "tests").rglob("test_*.py"))
    missing = [f.__name__ for f in hook_specs() if f"def test_hook_{f.__name__}(" not in sources]
    assert not missing, f"hooks without a test_hook_<name>: {missing}"


def test_every_kind_maps_to_a_spec():
    names = {f.__name__ for f in hook_specs()}
    assert {kind.hook_name for kind in Kind} <= names
    assert all(hasattr(hookspecs, kind.hook_name) for kind in Kind)


def test_only_the_facade_calls_pm_hook():
    offenders = []
    for folder in ("core", "plugins"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.relative_to(ROOT).as_posix() == "core/foretell/plugin/hooks.py":
                continue
            if re.search(r"\bpm\.hook\b", path.read_text(encoding="utf-8")):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders
