"""Configuration errors name the file, the field path and what is wrong. Messages pinned."""

import attrs
import pytest

from foretell import hookimpl
from foretell.config import RunConfig, at_least, load_run_config
from foretell.errors import ConfigError


@attrs.frozen(kw_only=True)
class TwoModelOptions:
    model: str
    num_tokens: int = attrs.field(default=4, validator=at_least(1))


class DraftPlugin:
    @hookimpl
    def foretell_register_draft_providers(self, register):
        register("two-model", "x.y:Provider", config=TwoModelOptions)
        register("plain", "x.y:Plain")


@pytest.fixture
def registry(foretell_plugins):
    with foretell_plugins.temporary(DraftPlugin(), name="drafts"):
        yield foretell_plugins.registry


def _errors(registry, tmp_path, text, **overrides):
    path = tmp_path / "run.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_run_config(registry, path, overrides)
    return str(info.value).replace(str(path), "run.toml")


def test_a_valid_file_structures_polymorphic_sections(registry, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('max_tokens = 9\n[sampling]\ntemp = 0.7\nseed = 3\n[draft]\nkind = "two-model"\nmodel = "d"\n')
    config = load_run_config(registry, path)
    assert config.max_tokens == 9 and config.sampling.temp == 0.7 and config.sampling.seed == 3
    assert config.draft.kind == "two-model" and config.draft.options == TwoModelOptions(model="d")


def test_out_of_range_value_in_a_plugin_section(registry, tmp_path):
    text = '[draft]\nkind = "two-model"\nmodel = "d"\nnum_tokens = 0\n'
    assert _errors(registry, tmp_path, text) == "run.toml: draft.num_tokens: must be >= 1, got 0"


def test_unknown_key_names_the_path_and_the_known_fields(registry, tmp_path):
    assert _errors(registry, tmp_path, "[sampling]\ntmp = 1\n") == (
        "run.toml: sampling.tmp: unknown field (known: min_p, repetition_context_size, "
        "repetition_penalty, seed, temp, top_k, top_p)"
    )


def test_unknown_key_in_a_plugin_section(registry, tmp_path):
    text = '[draft]\nkind = "two-model"\nmodel = "d"\nnum_tokns = 2\n'
    assert _errors(registry, tmp_path, text) == (
        "run.toml: draft.num_tokns: unknown field (known: model, num_tokens)"
    )


def test_missing_required_field_of_a_plugin_section(registry, tmp_path):
    text = '[draft]\nkind = "two-model"\n'
    assert _errors(registry, tmp_path, text) == "run.toml: draft.model: required field missing"


def test_unknown_kind_lists_the_installed_ones(registry, tmp_path):
    assert _errors(registry, tmp_path, '[draft]\nkind = "eagle"\n') == (
        "run.toml: draft.kind: no draft named 'eagle' is installed (installed: plain, two-model); "
        "install a plugin that provides this draft kind (see `foretell plugins`)"
    )


def test_options_without_a_kind_ask_for_the_kind_they_belong_to(registry, tmp_path):
    assert _errors(registry, tmp_path, "[draft]\ndepth = 3\n") == (
        "run.toml: draft.kind: required: one of plain, two-model, to take the options given (depth)")


def test_options_given_to_a_kind_without_config(registry, tmp_path):
    text = '[draft]\nkind = "plain"\ndepth = 3\n'
    assert _errors(registry, tmp_path, text) == (
        "run.toml: draft.depth: unknown field: draft 'plain' takes no options"
    )


def test_draft_settings_given_with_speculation_off_are_refused(registry, tmp_path):
    assert _errors(registry, tmp_path, '[draft]\nkind = "none"\nnum_tokens = 3\n') == (
        "run.toml: draft.num_tokens: draft kind 'none' turns speculation off: no draft "
        "setting applies")


def test_a_kind_chosen_by_flag_drops_the_files_options_of_another_kind(registry, tmp_path):
    """`--draft none` turns off the drafter a config file sets up; another kind by flag
    keeps the file's shared settings and drops the other drafter's own options."""
    path = tmp_path / "run.toml"
    path.write_text('[draft]\nkind = "two-model"\nmodel = "d"\nnum_tokens = 3\n')
    off = load_run_config(registry, path, {"draft.kind": ("none", "--draft")})
    assert off.draft.kind == "none" and off.draft.settings.num_tokens is None
    plain = load_run_config(registry, path, {"draft.kind": ("plain", "--draft")})
    assert plain.draft.kind == "plain" and plain.draft.settings.num_tokens == 3
    same = load_run_config(registry, path, {"draft.kind": ("two-model", "--draft")})
    assert same.draft.options is not None and same.draft.settings.num_tokens == 3
    with pytest.raises(ConfigError, match="set by --num-draft-tokens"):  # given together
        load_run_config(registry, path, {"draft.kind": ("none", "--draft"),
                                         "draft.num_tokens": (2, "--num-draft-tokens")})


def test_wrong_types_are_not_coerced(registry, tmp_path):
    assert _errors(registry, tmp_path, 'max_tokens = "12"\n') == (
        "run.toml: max_tokens: expected an integer, got '12'"
    )
    assert _errors(registry, tmp_path, "chat = 1\n") == "run.toml: chat: expected true or false, got 1"


def test_problems_in_several_sections_are_reported_together(registry, tmp_path):
    text = "bogus = 1\n[sampling]\ntop_k = -1\n[draft]\nkind = \"two-model\"\n"
    assert _errors(registry, tmp_path, text).splitlines() == [
        "run.toml: sampling.top_k: must be >= 0, got -1",
        "run.toml: draft.model: required field missing",
        "run.toml: bogus: unknown field (known: cache, chat, draft, max_tokens, model, sampling, "
        "serve)",
    ]


def test_cli_override_errors_name_the_flag(registry):
    with pytest.raises(ConfigError) as info:
        load_run_config(registry, None, {"sampling.temp": (-0.5, "--temp")})
    assert str(info.value) == "command line: sampling.temp: must be >= 0.0, got -0.5 (set by --temp)"


def test_overrides_win_over_the_file(registry, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("max_tokens = 9\n[sampling]\ntemp = 0.7\n")
    config = load_run_config(registry, path, {"max_tokens": (3, "--max-tokens"), "sampling.top_k": (None, "--top-k")})
    assert config.max_tokens == 3 and config.sampling.temp == 0.7 and config.sampling.top_k == 0


def test_unreadable_and_malformed_files(registry, tmp_path):
    with pytest.raises(ConfigError, match=r"missing.toml: cannot read: No such file or directory"):
        load_run_config(registry, tmp_path / "missing.toml")
    assert _errors(registry, tmp_path, "max_tokens = = 3\n").startswith("run.toml: invalid TOML: ")


def test_defaults_are_valid():
    assert RunConfig().max_tokens == 256 and RunConfig().sampling.temp == 0.0
