"""Inputs that gave tracebacks or misleading errors now give one line naming the file and
the field or tensor (issue 48, item 8)."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from foretell.cli import main
from foretell.config import load_run_config
from foretell.errors import ChatTemplateError, ConfigError, ModelLoadError
from foretell.model import load_model
from foretell.plugin import load_plugins
from foretell.tokenizer import ChatTemplate
from foretell.tools.synthetic import make_model_dir

CONVERSATION = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


# -- the run configuration ---------------------------------------------------------------


def test_a_config_file_that_is_not_utf8_is_named_in_one_line(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_bytes(b"max_tokens = 5\n# caf\xe9\n")
    assert main(["run", "--config", str(path), "--prompt", "x"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"foretell: error: {path}: not UTF-8 text (byte 20: b'\\xe9'); "
                   "TOML files are UTF-8")


@pytest.mark.parametrize("section", ["sampling", "cache"])
def test_a_section_given_as_a_number_says_it_wants_a_table(registry, tmp_path, section):
    path = tmp_path / "run.toml"
    path.write_text(f"{section} = 3\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_run_config(registry, path)
    assert str(info.value) == f"{path}: {section}: expected a table, got 3"


# -- chat templates -------------------------------------------------------------------------

ORIGIN = Path("model/tokenizer_config.json")


def render(source: str) -> str:
    return ChatTemplate(source, ORIGIN, {}).render(CONVERSATION)


def test_a_recursing_chat_template_is_named(tmp_path):
    with pytest.raises(ChatTemplateError) as info:
        render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
    assert str(info.value) == (
        f"{ORIGIN}: the chat template recurses without end (a macro that calls itself?)"
    )


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' * 64 }}"
         "{% endfor %}{% endfor %}", "produced more than"),
        ("{{ 'x' * 10000000000 }}", "repeats a sequence of 1 x 10000000000"),
        ("{{ messages * 100000000 }}", "repeats a sequence of 1 x 100000000"),
        ("{{ 10 ** 10000000000 }}", "computes 10 ** 10000000000"),
        ("{{ 'x'.ljust(10000000000) }}", "passes 10000000000 to ljust"),
        ("{{ 'x' | center(10000000000) }}", "passes 10000000000 to the center filter"),
        ("{{ messages | tojson(indent=10000000000) }}", "to the tojson filter"),
        ("{{ '%10000000000d' | format(1) }}", "to the format filter"),
        ("{{ '%10000000000d' % 1 }}", "passes 10000000000 to '%'"),
        ("{{ '%*d' % (10000000000, 1) }}", "passes 10000000000 to '%'"),
        ("{{ '{:>10000000000}'.format(1) }}", "to str.format"),
    ],
)
def test_a_chat_template_that_would_blow_up_is_stopped_before_it_allocates(source, says):
    with pytest.raises(ChatTemplateError) as info:
        render(source)
    message = str(info.value)
    assert message.startswith(f"{ORIGIN}: the chat template ") and says in message
    assert message.endswith("it is broken or hostile; fix or replace the template")


def test_the_bounds_leave_ordinary_templates_alone():
    source = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
              "{{ '-' * 3 }}{{ 2 ** 10 }}{{ '%05d' % 42 }}{{ '{:>4}'.format(7) }}"
              "{{ 'x' | center(5) }}{{ '%s+%s' | format(1, 2) }}{{ 7 % 3 }}")
    assert render(source) == "<user>hi---102400042   7  x  1+21"


def test_a_long_conversation_is_not_mistaken_for_an_overflowing_template():
    content = "y" * (20 << 20)  # longer than the fixed headroom alone
    out = ChatTemplate("{{ messages[0].content }}", ORIGIN, {}).render(
        [{"role": "user", "content": content}])
    assert out == content


# -- weights that do not match --------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("q4") / "qwen3", "qwen3", quantize_bits=4)


def broken_copy(quantized: Path, tmp_path: Path, edit) -> Path:
    model_dir = shutil.copytree(quantized, tmp_path / "model")
    file = model_dir / "model.safetensors"
    weights = dict(mx.load(str(file)))
    edit(weights)
    mx.save_safetensors(str(file), weights)
    return model_dir


LAYER = "model.layers.0.self_attn.q_proj"


def test_a_deleted_quantized_weight_is_named_with_its_file(quantized, tmp_path, registry):
    model_dir = broken_copy(quantized, tmp_path, lambda w: w.pop(f"{LAYER}.weight"))
    with pytest.raises(ModelLoadError) as info:
        load_model(model_dir, registry)
    assert str(info.value) == (
        f"{model_dir / 'model.safetensors'}: missing tensor '{LAYER}.weight' (its "
        f"quantization scales '{LAYER}.scales' are there)"
    )


def test_deleted_quantization_scales_are_named_with_their_file(quantized, tmp_path, registry):
    model_dir = broken_copy(quantized, tmp_path, lambda w: w.pop(f"{LAYER}.scales"))
    with pytest.raises(ModelLoadError) as info:
        load_model(model_dir, registry)
    assert str(info.value).startswith(
        f"{model_dir / 'model.safetensors'}: missing tensor '{LAYER}.scales'")


def test_a_deleted_dense_tensor_is_named_with_its_file(quantized, tmp_path, registry):
    model_dir = broken_copy(quantized, tmp_path, lambda w: w.pop("model.norm.weight"))
    with pytest.raises(ModelLoadError) as info:
        load_model(model_dir, registry)
    assert str(info.value) == (
        f"{model_dir / 'model.safetensors'}: missing tensor(s) the model needs: "
        "'model.norm.weight'"
    )


@pytest.mark.parametrize("part", ["weight", "scales"])
def test_a_transposed_quantized_tensor_reports_expected_and_found_shapes(
    quantized, tmp_path, registry, part
):
    name = f"{LAYER}.{part}"
    stored = mx.load(str(quantized / "model.safetensors"))[name].shape
    model_dir = broken_copy(quantized, tmp_path, lambda w: w.__setitem__(name, w[name].T))
    with pytest.raises(ModelLoadError) as info:
        load_model(model_dir, registry)
    message = str(info.value)
    assert message.startswith(
        f"{model_dir / 'model.safetensors'}: tensor '{name}' has shape "
        f"{tuple(reversed(stored))}, expected {tuple(stored)} (4-bit, groups of 64")
    assert "bits 32" not in message and "is the tensor transposed" in message


# -- the CLI's flags (issue 48, item 14) --------------------------------------------------


def _subcommand_parsers():
    import argparse

    from foretell.cli import build_parser

    def walk(parser, name):
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    yield from walk(child, f"{name} {sub}")

    return list(walk(build_parser(), "foretell"))


def _option_help(parser) -> dict[str, str]:
    """Each option that takes a value, and its help as ``--help`` prints it."""
    import argparse

    formatter = parser._get_formatter()
    return {
        action.option_strings[0]: formatter._expand_help(action)
        for action in parser._actions
        if action.option_strings and action.nargs != 0 and not action.required
        and action.help not in (None, argparse.SUPPRESS)
    }


def test_every_option_of_every_subcommand_states_its_default_in_help():
    missing = [f"{name} {flag}" for name, parser in _subcommand_parsers()
               for flag, text in _option_help(parser).items() if "default" not in text]
    assert missing == []


def test_run_flags_state_the_run_configs_own_defaults():
    import functools
    import re

    from foretell.cli.run_cmd import _FLAG_FIELDS
    from foretell.config import RunConfig

    def config_default(dotted: str):
        return functools.reduce(getattr, dotted.split("."), RunConfig())

    parser = dict(_subcommand_parsers())["foretell run"]
    helps = _option_help(parser)
    checked = 0
    for attr, field in _FLAG_FIELDS.items():
        default = config_default(field)
        if default is None or isinstance(default, bool):
            continue  # stated in words ("none", "off"), not a value
        stated = re.search(r"default: ([^,;)\s]+)", helps["--" + attr.replace("_", "-")])
        assert stated is not None, attr
        value = stated.group(1)
        assert (value == default) if isinstance(default, str) else float(value) == default, attr
        checked += 1
    assert checked >= 8


def test_bench_names_where_synthetic_models_go_models_dir():
    parser = dict(_subcommand_parsers())["foretell bench"]
    assert str(parser.parse_args(["--models-dir", "/somewhere"]).models_dir) == "/somewhere"
    assert "--cache-dir" not in parser.format_help()
    assert "~/.cache/foretell/bench" in _option_help(parser)["--models-dir"]


def test_bench_cache_dir_says_what_it_became(capsys):
    assert main(["bench", "--synthetic", "30m", "--cache-dir", "/x"]) == 1
    assert capsys.readouterr().err == (
        "foretell: error: --cache-dir /x: bench calls it --models-dir (where --synthetic models "
        "are kept); --cache-dir names a KV cache directory in `foretell run`, `chat` and "
        "`cache`\n"
    )


# -- the demo: completion, not chat (issue 48, items 12 and 15) ---------------------------


def run_json(argv, capsys):
    import json

    assert main(["run", "--json", *argv]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    text = "".join(e["text"] for e in lines if e["type"] == "text")
    return text, lines[-1]


def test_the_default_run_ends_the_function_instead_of_repeating_it(capsys):
    from foretell.cli.run_cmd import DEFAULT_PROMPT

    text, stats = run_json([], capsys)
    assert stats["finish_reason"] == "stop" and stats["generated_tokens"] < 256
    assert "def " not in text and text.strip()  # one body, no second def
    # The same greedy run without the model's stop strings repeats the function.
    more, stats = run_json(["--no-model-stops", "--max-tokens", "120"], capsys)
    assert stats["finish_reason"] == "length" and more.startswith(text)
    assert (DEFAULT_PROMPT + more).count(DEFAULT_PROMPT) > 1


def test_the_demo_declares_stop_strings_the_python_api_applies_only_when_passed():
    import foretell

    engine = foretell.load("demo")
    assert engine.tokenizer.stop_strings == ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
    assert not engine.tokenizer.has_chat_template
    plain = engine.generate_text("def fibonacci(n):", max_tokens=80, speculate=False)
    assert "\ndef " in plain  # mlx-lm's API has no model stop strings: neither has ours
    stopped = engine.generate_text("def fibonacci(n):", max_tokens=80, speculate=False,
                                   stop=engine.tokenizer.stop_strings)
    assert plain.startswith(stopped) and len(stopped) < len(plain)


def test_stop_strings_that_are_not_strings_are_refused_naming_the_file(tmp_path):
    import json

    from foretell.errors import TokenizerError
    from foretell.tokenizer import Tokenizer

    model_dir = make_model_dir(tmp_path / "m", "qwen3")
    (model_dir / "generation_config.json").write_text(json.dumps({"stop_strings": [3]}))
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_dir(model_dir)
    assert str(info.value) == (f"{model_dir / 'generation_config.json'}: stop_strings must be "
                               "a non-empty string or a list of them, got [3]")


def test_chat_on_a_model_without_a_template_says_so_and_continues_the_transcript(
    capsys, monkeypatch
):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("def add(a, b):\n"))
    assert main(["chat", "--max-tokens", "40", "--draft", "none"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(
        "demo has no chat template: it completes text rather than following instructions.")
    # The reply continues the message as code (the old template made it a '# comment').
    import foretell

    expected = foretell.load("demo").generate_text(
        "def add(a, b):", max_tokens=40, speculate=False,
        stop=("\nclass", "\ndef", "\n#", "\nif", "\nprint"))
    assert captured.out == expected + "\n"


def test_a_transcript_starts_each_message_on_a_new_line_and_continues_each_reply():
    from foretell.cli.chat_cmd import transcript

    history = [{"role": "system", "content": "import math"},
               {"role": "user", "content": "def area(r):"},
               {"role": "assistant", "content": "\n    return math.pi * r * r\n"},
               {"role": "user", "content": "def side(a):"},
               {"role": "assistant", "content": " return a"}]
    assert transcript(history) == ("import math\ndef area(r):\n    return math.pi * r * r\n"
                                   "def side(a): return a")


# -- the CPU's unpacked quantized path (issue 48, item 18) ---------------------------------


@pytest.mark.parametrize(("bits", "dtype"), [(4, "bfloat16"), (8, "float16")])
def test_unpacking_dequantizes_exactly_not_in_the_scales_dtype(tmp_path, registry, bits, dtype):
    """scales * q + biases is exact in float32 (a 16-bit scale times a <= 8-bit integer plus a
    16-bit bias), so the unpacked model is the checkpoint's own, not its weights rounded to
    the scales' dtype (which moved logits ~3% from the float64 model)."""
    import mlx.nn as nn
    import numpy as np

    from foretell.model import unpack_quantized

    model_dir = make_model_dir(tmp_path / "m", "qwen3", quantize_bits=bits, dtype=dtype)
    stored = mx.load(str(model_dir / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    packed = stored[f"{name}.weight"]
    words = np.array(packed).astype(np.uint64)[..., None]
    shifts = np.arange(32 // bits, dtype=np.uint64) * bits
    q = ((words >> shifts) & ((1 << bits) - 1)).reshape(packed.shape[0], -1, 64)
    scales, biases = (np.array(stored[f"{name}.{part}"].astype(mx.float32), dtype=np.float64)
                      for part in ("scales", "biases"))
    exact = (q * scales[..., None] + biases[..., None]).reshape(packed.shape[0], -1)
    model = load_model(model_dir, registry, lazy=True)
    if any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules()):
        unpack_quantized(model)  # a GPU, or FORETELL_CPU_UNPACK=0, kept them packed
    weight = dict(model.named_modules())[name].weight
    assert weight.dtype == mx.float32
    assert np.array_equal(np.array(weight, dtype=np.float64), exact)
