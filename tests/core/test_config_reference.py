"""docs/reference/config.md is generated from the attrs config classes, plugin ones included,
and a test fails when the committed page is stale (as for the hook reference)."""

from __future__ import annotations

from pathlib import Path

import attrs

from foretell import config, hookimpl
from foretell.plugin.docgen import render_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_config_reference_is_current():
    committed = (ROOT / "docs" / "reference" / "config.md").read_text(encoding="utf-8")
    assert committed == render_config(), "run `python -m foretell.plugin.docgen` and commit the result"


def test_every_key_of_every_section_is_documented_with_its_help():
    page = render_config()
    for cls in (config.RunConfig, config.SamplingConfig):
        for field in attrs.fields(cls):
            if attrs.has(field.type) or field.name in ("draft", "cache", "sampling", "serve"):
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


def documented_sections(page: str) -> dict[tuple[str, str | None], dict[str, str]]:
    """``{(section, provider): {key: default}}`` for every table the page says a run config
    reads (sections "not read from the run config" are skipped)."""
    found: dict[tuple[str, str | None], dict[str, str]] = {}
    section, provider = None, None
    for line in page.splitlines():
        if line.startswith("## "):
            section = "" if line == "## Top level" else None
            if line.startswith("## `["):
                section = line.split("`[")[1].split("]")[0]
            provider = None
        elif line.startswith("### `") and section is not None:
            provider = line.split("`")[1]
        elif line.startswith("| `") and section is not None:
            key, _type, default = (cell.strip() for cell in line.strip("|").split("|")[:3])
            found.setdefault((section, provider), {})[key.strip("`")] = default
    return found


def test_every_documented_key_is_accepted_where_the_page_puts_it(tmp_path):
    from foretell.plugin import PluginSwitches, load_plugins

    registry = load_plugins(switches=PluginSwitches()).registry
    sections = documented_sections(render_config())
    assert ("draft", "two-model") in sections and ("sampling", None) in sections
    for (section, provider), keys in sections.items():
        values = {k: d.strip("`") for k, d in keys.items() if d.startswith("`")}
        if section == "draft":
            if provider is None:
                continue  # the shared keys are checked with each provider
            values = {**{k: d.strip("`") for k, d in sections[("draft", None)].items()
                         if d.startswith("`")}, **values, "kind": f'"{provider}"'}
        if section == "cache" and provider is not None:
            values = {**values, "layout": f'"{provider}"'}  # a layout's keys follow its name
        body = "\n".join(f"{k} = {v}" for k, v in values.items())
        text = f"[{section}]\n{body}\n" if section else body + "\n"
        path = tmp_path / "run.toml"
        path.write_text(text)
        config.load_run_config(registry, path)  # raises, naming the key, if the page lies
