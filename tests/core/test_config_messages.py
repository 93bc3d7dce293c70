"""Config and lookup errors say what is there: no empty "known:" lists, and a disabled
plugin is reported as disabled, not as missing."""

from __future__ import annotations

import attrs
import pytest

from foretell import hookimpl
from foretell.config import load_run_config
from foretell.errors import ConfigError, UnknownContribution
from foretell.plugin import Kind, PluginSwitches, load_plugins


@attrs.frozen(kw_only=True)
class NoOptions:
    """A provider config class with no fields."""


class Drafts:
    @hookimpl
    def foretell_register_draft_providers(self, register):
        register("bare", "x.y:Bare", config=NoOptions)


def test_an_option_for_a_config_class_without_fields_says_it_takes_none(foretell_plugins):
    with foretell_plugins.temporary(Drafts(), name="drafts"):
        with pytest.raises(ConfigError) as info:
            load_run_config(
                foretell_plugins.registry,
                overrides={"draft": ({"kind": "bare", "depth": 3}, "--draft")},
            )
    assert str(info.value) == (
        "command line: draft.depth: unknown field: draft 'bare' takes no options"
    )


DRAFTER = """
from foretell import hookimpl

@hookimpl
def foretell_register_draft_providers(register):
    register("mydraft", "x.y:Provider")
"""


@attrs.frozen(kw_only=True)
class Outer:
    inner: NoOptions = attrs.Factory(NoOptions)


def test_an_unknown_key_in_a_section_without_fields_says_the_section_takes_none(
    foretell_plugins,
):
    from foretell.config import make_converter, structure

    conv = make_converter(foretell_plugins.registry)
    with pytest.raises(ConfigError) as info:
        structure(conv, {"inner": {"x": 1}}, Outer, "run.toml")
    assert str(info.value) == "run.toml: inner.x: unknown field (this section takes no options)"


def test_selecting_a_disabled_plugin_says_it_is_disabled(fake_distribution):
    fake_distribution(
        "foretell-mydraft", "1.0",
        entry_points={"foretell.plugins": {"mydraft": "foretell_mydraft"}},
        modules={"foretell_mydraft": DRAFTER},
    )
    registry = load_plugins(switches=PluginSwitches(block=frozenset({"mydraft"}))).registry
    with pytest.raises(UnknownContribution) as info:
        registry.get(Kind.DRAFT, "mydraft")
    message = str(info.value)
    assert "is installed but disabled" in message and "not installed" not in message
    assert "FORETELL_DISABLE_PLUGINS" in message


def test_a_missed_name_lists_the_disabled_plugins_that_might_provide_it(fake_distribution):
    fake_distribution(
        "foretell-mydraft", "1.0",
        entry_points={"foretell.plugins": {"mydraft": "foretell_mydraft"}},
        modules={"foretell_mydraft": DRAFTER},
    )
    registry = load_plugins(switches=PluginSwitches(block=frozenset({"mydraft"}))).registry
    with pytest.raises(UnknownContribution, match="disabled plugins, which may provide it: mydraft"):
        registry.get(Kind.DRAFT, "other-name")
