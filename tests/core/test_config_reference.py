"""docs/reference/config.md is generated from the attrs config classes, plugin ones included,
and a test fails when the committed page is stale (as for the hook reference)."""

from __future__ import annotations

from pathlib import Path

import attrs

from foretell import config, hookimpl
from foretell.docgen import render_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_config_reference_is_current():
    committed = (ROOT / "docs" / "reference" / "config.md").read_text(encoding="utf-8")
    assert committed == render_config(), "run `python -m foretell.docgen` and commit the result"


def test_every_key_of_every_section_is_documented_with_its_help():
    page = render_config()
    for cls in (config.RunConfig, config.SamplingConfig):
        for field in attrs.fields(cls):
            if attrs.has(field.type) or field.name in ("draft", "cache", "sampling"):
                assert f"## `[{field.name}]`" in page
                continue
            assert f"| `{field.name}` |" in page
            assert field.metadata["help"].replace("``", "`") in page


@attrs.frozen(kw_only=True)
class WindowOptions:
    window: int = attrs.field(default=7, metadata={"help": "how far back the toy drafter looks"})


class ToyDrafter:
    @hookimpl
    def foretell_register_draft_providers(self, register):
        register("toy", "toy.mod:Provider", config=WindowOptions, summary="a toy drafter")


def test_a_plugins_config_class_is_documented_through_the_registry(foretell_plugins):
    with foretell_plugins.temporary(ToyDrafter(), name="toy-plugin", kind="built-in"):
        page = render_config(foretell_plugins.registry)
    assert "### `toy` (plugin `toy-plugin`, `WindowOptions`)" in page
    assert "| `window` | int | `7` | how far back the toy drafter looks |" in page
    assert "`toy`" in page.split("| `kind` |")[1].splitlines()[0]  # listed as a kind


def test_third_party_options_stay_in_their_own_docs(foretell_plugins):
    with foretell_plugins.temporary(ToyDrafter(), name="toy-plugin"):
        assert "WindowOptions" not in render_config(foretell_plugins.registry)
