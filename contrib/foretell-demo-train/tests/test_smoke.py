"""End-to-end run of the tiny configuration on CPU: corpus -> tokenizer -> four models ->
evaluation -> MLX-quantized export -> pack/unpack. Skips where torch is not installed."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the demo trainer needs PyTorch, which the [test] extra leaves out")
pytest.importorskip("tokenizers")
st = pytest.importorskip("safetensors.torch")

DIRS = ["demo", "demo-draft", "demo-gemma"]


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


@pytest.mark.slow
def test_dirs_are_complete_quantized_checkpoints(produced):
    out = produced / "out"
    for name in DIRS:
        d = out / name
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json", "special_tokens_map.json", "training.json"):
            assert (d / f).is_file(), f"{name}/{f}"
        cfg = _config(d)
        q = cfg["quantization"]
        assert q["group_size"] == 64 and q["bits"] in (4, 8)
        w = st.load_file(str(d / "model.safetensors"))
        emb = w["model.embed_tokens.weight"]
        assert emb.dtype == torch.uint32
        assert tuple(emb.shape) == (cfg["vocab_size"], cfg["hidden_size"] * q["bits"] // 32)
        assert tuple(w["model.embed_tokens.scales"].shape) == (cfg["vocab_size"], cfg["hidden_size"] // 64)
        assert "lm_head.weight" not in w
        assert "model.norm.weight" in w
        assert len([k for k in w if k.endswith("self_attn.q_proj.weight")]) == cfg["num_hidden_layers"]
    gemma = _config(out / "demo-gemma")
    assert gemma["model_type"] == "gemma3_text"
    assert "sliding_attention" in gemma["layer_types"] and "full_attention" in gemma["layer_types"]
    mtp = st.load_file(str(out / "demo" / "mtp.safetensors"))
    H = _config(out / "demo")["hidden_size"]
    for key in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight",
                "mtp.layers.0.mlp.down_proj.weight"):
        assert key in mtp
    assert tuple(mtp["mtp.fc.scales"].shape) == (H, 2 * H // 64)


@pytest.mark.slow
def test_quality_and_training_records(produced):
    out = produced / "out"
    q = json.loads((out / "quality.json").read_text())
    for name in ("target", "draft", "gemma", "mtp"):
        m = q["models"][name]
        loss = m["shipped"].get("loss", m["shipped"].get("loss_t_plus_2"))
        assert math.isfinite(loss)
    assert len(q["completions"]["shipped"]) == 3
    assert "expected_accepted_of_4_temp0.8" in q["speculative"]["shipped"]["draft_teacher_forced"]
    assert q["weights_total_mib"] <= q["size_budget_mib"]
    t = json.loads((out / "demo" / "training.json").read_text())
    assert t["tokenizer"]["chosen_vocab_size"] == _config(out / "demo")["vocab_size"]
    assert "mtp" in t and t["corpus"]["heldout_files"] > 0
    assert (out / "manifest.txt").read_text().count("\n") > 10


@pytest.mark.slow
def test_pack_roundtrip(produced, tmp_path):
    from foretell_demo_train.pack import unpack

    parts = sorted((produced / "pack").iterdir())
    assert 1 <= len(parts) <= 8
    unpack(produced / "pack", tmp_path)
    for name in DIRS:
        assert (tmp_path / name / "model.safetensors").read_bytes() == (
            produced / "out" / name / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_mlx_lm_loads_and_matches(produced):
    """mlx-lm loads each shipped dir; its held-out loss equals the script's quantized loss."""
    if sys.platform != "darwin" and not _has_mlx():
        pytest.skip("mlx_lm not importable")
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import generate, load

    from foretell_demo_train.evaluate import heldout_windows
    from foretell_demo_train.presets import TINY

    out = produced / "out"
    q = json.loads((out / "quality.json").read_text())
    held = np.load(produced / "work" / "tokens_heldout.npy")
    windows = heldout_windows(held, TINY.seq_len, TINY.eval_windows)
    for name, key in zip(DIRS, ("target", "draft", "gemma")):
        model, tok = load(str(out / name))
        x = mx.array(windows)
        logits = model(x[:, :-1]).astype(mx.float32)
        loss = nn.losses.cross_entropy(logits, x[:, 1:]).mean().item()
        assert abs(loss - q["models"][key]["shipped"]["loss"]) < 0.05, (name, loss)
        text = generate(model, tok, prompt="def add(a, b):\n", max_tokens=8)
        assert isinstance(text, str)


def _has_mlx() -> bool:
    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        return False
    return True
