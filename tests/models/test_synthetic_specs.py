"""Synthetic checkpoints come from the architecture plugins' registered specs: core names no
model type, and a third-party architecture gets test and bench models by registering one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file

import foretell
from foretell import hookimpl
from foretell.cli import main
from foretell.errors import PluginError
from foretell.plugin import Kind, load_plugins
from foretell.tools import synthetic

CORE = Path(foretell.__file__).parent

TOY = """
from foretell import hookimpl
from foretell.tools import TOKENIZER_VOCAB, SyntheticSpec

SPEC = SyntheticSpec(
    config={
        "model_type": "toy_decoder", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "vocab_size": TOKENIZER_VOCAB, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": True,
    },
    presets={"toy-wide": {"hidden_size": 64, "num_attention_heads": 4}},
)

@hookimpl
def foretell_register_architectures(register):
    # a third party's own model type, built by any architecture's builder
    register("toy_decoder", "foretell_qwen.qwen3:build", synthetic="foretell_toy:SPEC")
"""


@pytest.fixture
def toy_architecture(fake_distribution):
    fake_distribution(
        "foretell-toy", "1.0",
        entry_points={"foretell.plugins": {"toy": "foretell_toy"}},
        modules={"foretell_toy": TOY},
    )


def test_a_third_party_architecture_gets_synthetic_models_for_free(toy_architecture, tmp_path):
    registry = load_plugins().registry
    assert "toy_decoder" in synthetic.model_types(registry)
    path = synthetic.make_model_dir(tmp_path / "toy", "toy_decoder", registry=registry)
    assert json.loads((path / "config.json").read_text())["model_type"] == "toy_decoder"
    engine = foretell.load(path, registry=registry)
    stats = list(engine.generate("def f(x):", max_tokens=3, ignore_eos=True))[-1]
    assert stats.generated_tokens == 3


def test_a_third_party_preset_is_a_bench_shape(toy_architecture, tmp_path):
    registry = load_plugins().registry
    assert synthetic.presets(registry)["toy-wide"] == "toy_decoder"
    path = synthetic.make_preset_dir(tmp_path / "wide", "toy_decoder:toy-wide", registry=registry)
    assert json.loads((path / "config.json").read_text())["hidden_size"] == 64


def test_an_unknown_bench_shape_lists_the_shapes_with_their_architectures(capsys):
    assert main(["bench", "--synthetic", "7b"]) == 1
    err = capsys.readouterr().err
    assert "--synthetic 7b: unknown shape" in err and "30m (qwen3)" in err


def test_core_tools_name_no_model_type():
    names = synthetic.model_types()
    assert {"qwen3", "qwen2", "gemma3_text", "gemma4_text"} <= set(names)
    for module in ("tools/synthetic.py", "tools/bench.py", "tools/measure.py", "cli/bench_cmd.py"):
        source = (CORE / module).read_text()
        assert [n for n in names if f'"{n}"' in source or f"'{n}'" in source] == [], module


def _norm_means(path: Path) -> float:
    weights = load_file(str(path / "model.safetensors"))
    return float(
        sum(w.mean() for n, w in weights.items() if n.endswith("input_layernorm.weight"))
        / sum(1 for n in weights if n.endswith("input_layernorm.weight"))
    )


def test_a_specs_norm_offset_is_how_its_checkpoint_stores_norms(tmp_path):
    # Gemma 3's spec says its norms are stored as offsets from one; Qwen3's says nothing.
    assert synthetic.spec_for("gemma3_text").norm_offset == 1.0
    gemma = _norm_means(synthetic.make_model_dir(tmp_path / "g", "gemma3_text"))
    qwen = _norm_means(synthetic.make_model_dir(tmp_path / "q", "qwen3"))
    assert abs(gemma) < 0.1 and abs(qwen - 1.0) < 0.1


def test_an_architecture_without_a_spec_is_named_in_the_error(foretell_plugins, tmp_path):
    class Bare:
        @hookimpl
        def foretell_register_architectures(self, register):
            register("bare_arch", "x.y:build")

    with foretell_plugins.temporary(Bare(), name="bare"):
        with pytest.raises(ValueError, match="no synthetic config for 'bare_arch'"):
            synthetic.make_model_dir(tmp_path / "b", "bare_arch", registry=foretell_plugins.registry)


def test_synthetic_is_refused_outside_architectures(foretell_plugins):
    class Wrong:
        @hookimpl
        def foretell_register_draft_providers(self, register):
            register("d", "x.y:Provider", synthetic="x.y:SPEC")

    record = foretell_plugins.register(Wrong(), "wrong")
    assert record.status == "failed" and "synthetic= is for architectures only" in record.error
    assert isinstance(record.exception, PluginError)
    assert Kind.DRAFT not in {c.kind for c in foretell_plugins.registry}
