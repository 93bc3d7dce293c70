"""Greedy decoding of adapted models is token for token mlx-lm's (its ``generate_step``, the
loop under ``mlx_lm.generate``) on the same weights, for families foretell has no native
plugin for: dense, sliding-window, MoE, recurrent and hybrid recurrent."""

from __future__ import annotations

import importlib

import mlx.core as mx
import pytest

PROMPT = [11, 57, 300, 4, 89, 120, 7, 250, 33, 64, 2, 199, 40, 41]
TOKENS = 24

FAMILIES = {
    "llama": "dense",
    "phi3": "dense, fused qkv",
    "starcoder2": "dense, layer norm and biases",
    "olmo2": "dense, post-norms",
    "granite": "dense, scaled residuals and logits",
    "cohere2": "sliding-window layers (mlx-lm's RotatingKVCache)",
    "mixtral": "mixture of experts",
    "qwen3_moe": "mixture of experts",
    "deepseek_v2": "latent attention, mixture of experts",
    "mamba": "recurrent (ArraysCache)",
    "qwen3_next": "hybrid: gated delta-net recurrence and attention",
}


def _mlx_lm_greedy(path, prompt, n):
    step = importlib.import_module("mlx_lm.generate").generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    out = []
    for token, _ in step(mx.array(prompt, dtype=mx.int32), model, max_tokens=n):
        out.append(int(token))
    return out


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_greedy_decoding_matches_mlx_lm(registry, model_dir, model_type):
    import foretell
    from foretell.plugin import Kind

    assert registry.get(Kind.ARCHITECTURE, model_type).origin.plugin == "mlxlm"
    path = model_dir(model_type)
    engine = foretell.load(path, registry=registry)
    events = list(engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True, speculate=False))
    ours = [t for e in events[:-1] for t in e.tokens]
    assert ours == _mlx_lm_greedy(path, PROMPT, TOKENS)
    assert len(set(ours)) > 1, "a constant continuation compares nothing"
