"""The target/draft size rule is one check, used before the draft trains and at export."""

import copy

import pytest

pytest.importorskip("torch", reason="the demo trainer needs PyTorch, which the [test] extra leaves out")

from foretell_demo_train.pipeline import require_draft_ratio  # noqa: E402
from foretell_demo_train.presets import FULL  # noqa: E402


def test_ratio_at_or_above_the_minimum_passes_and_below_names_both_counts():
    preset = copy.deepcopy(FULL)
    require_draft_ratio(preset, 8_000, 1_000)
    with pytest.raises(RuntimeError, match=r"ratio 7\.99 < 8\.0 \(7,990 / 1,000\)"):
        require_draft_ratio(preset, 7_990, 1_000)


def test_the_full_preset_trains_the_draft_shape_that_ships():
    """The family's pipeline reproduces the shipped draft's architecture (it came from
    ``redraft``; docs/demo-models.md), so a rerun of the whole family does not silently
    go back to another draft."""
    import json
    from pathlib import Path

    from foretell_demo_train.models import ModelSpec, hf_config

    shipped = Path(__file__).resolve().parents[3] / "core/foretell/demo/demo-draft/config.json"
    config = json.loads(shipped.read_text())
    ours = hf_config(ModelSpec(vocab_size=config["vocab_size"], **FULL.models["draft"]),
                     config["eos_token_id"])
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "layer_types",
                "sliding_window", "sliding_window_pattern"):
        assert ours[key] == config[key], key
