
"""Architectures against mlx-lm (the numerical oracle) on the same random checkpoints.

For each case: a tiny model directory from :mod:`foretell.tools.synthetic`, loaded by foretell
and by mlx-lm; prompt logits must agree to 1e-4 relative (float32) and a 32-token greedy
continuation, each side driving its own caches token by token, must be identical.
"""

import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model as mlx_lm_load_model

from foretell.model import load_model
from foretell.model.rope import DynamicNTKRoPE
from foretell.plugin import load_plugins
from foretell.tools import make_model_dir

GENERATED = 32
PROMPT = [11, 57, 300, 4, 89, 120, 7, 250, 33, 64, 2, 199]  # longer than the 8-token windows

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}
LONGROPE = {
    "rope_type": "longrope",
    "original_max_position_embeddings": 8,
    "short_factor": [1.0] * 8,
    "long_factor": [1.0 + 0.25 * i for i in range(8)],  # head_dim 16 -> 8 frequencies
}

CASES = {
    "qwen3": ("qwen3", {}, None),
    "qwen3-bfloat16": ("qwen3", {"torch_dtype": "bfloat16"}, None),
    "qwen2": ("qwen2", {}, None),
    "gemma3_text": ("gemma3_text", {}, None),
    "gemma4_text": ("gemma4_text", {}, None),
    "gemma4_text-bfloat16": ("gemma4_text", {"torch_dtype": "bfloat16"}, None),
    # Full layers with k == v and their own KV head count; an untied head without softcap.
    "gemma4_text-k_eq_v": (
        "gemma4_text",
        {
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
            "tie_word_embeddings": False,
            "final_logit_softcapping": None,
            "hidden_size_per_layer_input": 0,
            "num_kv_shared_layers": 0,
        },
        None,
    ),
    # RoPE scaling, with windows small enough that the tiny prompt runs past them.
    "qwen3-yarn": ("qwen3", {"rope_scaling": YARN}, None),
    "qwen3-yarn-rope_parameters": (
        "qwen3", {"rope_parameters": {**YARN, "rope_theta": 1e6}, "rope_theta": None}, None
    ),
    "qwen3-dynamic": ("qwen3", {"rope_scaling": DYNAMIC, "max_position_embeddings": 8}, None),
    "qwen3-longrope": ("qwen3", {"rope_scaling": LONGROPE, "max_position_embeddings": 64}, None),
    "qwen2-yarn": ("qwen2", {"rope_scaling": YARN}, None),
    "qwen2-dynamic": ("qwen2", {"rope_scaling": DYNAMIC, "max_position_embeddings": 8}, None),
    "qwen2-mrope": ("qwen2", {"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}, None),
    "qwen3-4bit": ("qwen3", {}, 4),
    "qwen2-8bit": ("qwen2", {}, 8),
    "gemma3_text-4bit": ("gemma3_text", {}, 4),
    "gemma4_text-4bit": ("gemma4_text", {}, 4),
    # On the CPU quantized weights are unpacked to float32 at load (loading.py); these keep
    # them packed, so both execution paths are held to the oracle.
    "qwen3-4bit-packed": ("qwen3", {"packed": True}, 4),
    "gemma4_text-4bit-packed": ("gemma4_text", {"packed": True}, 4),
    # bf16 scales (as the demo models and most mlx-community checkpoints have) run in bf16
    # in mlx-lm; packed, foretell runs the same kernels. The unpacked CPU default computes
    # in float32 instead (tests/demo pins what it equals).
    "qwen3-4bit-bfloat16-packed": ("qwen3", {"packed": True, "torch_dtype": "bfloat16"}, 4),
    "gemma3_text-4bit-bfloat16-packed": (
        "gemma3_text", {"packed": True, "torch_dtype": "bfloat16"}, 4
    ),
    "qwen2-8bit-packed": ("qwen2", {"packed": True}, 8),
    "qwen3-8bit-float16-packed": ("qwen3", {"packed": True, "torch_dtype": "float16"}, 8),
    "gemma4_text-4bit-float16-packed": (
        "gemma4_text", {"packed": True, "torch_dtype": "float16"}, 4
    ),
}


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


@pytest.fixture(scope="module", params=CASES.values(), ids=CASES.keys())
def pair(request, tmp_path_factory, registry):
    model_type, overrides, bits = request.param
    overrides = dict(overrides)
    dtype = overrides.pop("torch_dtype", "float32")
    packed = overrides.pop("packed", False)
    path = make_model_dir(
        tmp_path_factory.mktemp("model") / model_type,
        model_type,
        overrides=overrides,
        quantize_bits=bits,
        seed=7,
        dtype=dtype,
    )
    reference, _ = mlx_lm_load_model(Path(path))
    previous = os.environ.get("FORETELL_CPU_UNPACK")
    os.environ["FORETELL_CPU_UNPACK"] = "0" if packed else "1"
    try:
        model = load_model(path, registry)
    finally:
        os.environ.pop("FORETELL_CPU_UNPACK")
        if previous is not None:
            os.environ["FORETELL_CPU_UNPACK"] = previous
    if mx.default_device() == mx.cpu:
        assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules()) == (
            bool(bits) and packed
        )
    return model, reference


def relative_error(got, expected):
    return float(mx.abs(got - expected).max() / mx.abs(expected).max())


def greedy_foretell(model, prompt, n):
    caches = model.make_caches()
    hidden, _ = model.forward(mx.array([prompt]), caches)
    tokens = [int(mx.argmax(model.logits(hidden[:, -1]), axis=-1).item())]
    while len(tokens) < n:
        hidden, _ = model.forward(mx.array([[tokens[-1]]]), caches)
        tokens.append(int(mx.argmax(model.logits(hidden[:, -1]), axis=-1).item()))
    return tokens


def greedy_mlx_lm(model, prompt, n):
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    tokens = [int(mx.argmax(logits[:, -1], axis=-1).item())]
    while len(tokens) < n:
        logits = model(mx.array([[tokens[-1]]]), cache=cache)
        tokens.append(int(mx.argmax(logits[:, -1], axis=-1).item()))
    return tokens


def test_prompt_logits_match_mlx_lm(pair):
    model, reference = pair
    tokens = mx.array([PROMPT])
    got = model.logits(model.forward(tokens)[0])
    assert relative_error(got, reference(tokens)) <= 1e-4


def test_greedy_continuation_matches_mlx_lm(pair):
    model, reference = pair
    ours = greedy_foretell(model, PROMPT, GENERATED)
    assert ours == greedy_mlx_lm(reference, PROMPT, GENERATED)
    assert len(set(ours)) >= 4, "a degenerate random model would make this test vacuous"


def test_chunked_prefill_through_the_window_matches_one_shot(pair):
    """Multi-token updates after a sliding window wrapped (prefill chunks, verify windows)
    give the logits of one uncached pass over the whole sequence."""
    model, _ = pair
    if isinstance(model.layers[0].self_attn.rope, DynamicNTKRoPE):
        pytest.skip("dynamic NTK's base depends on each call's length (as in mlx-lm)")
    sequence = PROMPT + PROMPT[::-1] + PROMPT[:5]
    one_shot = model.logits(model.forward(mx.array([sequence]))[0])
    caches, start, chunks = model.make_caches(), 0, []
    for size in (5, 4, 1, 7, 3, 1, 1, 6, 1):
        hidden, _ = model.forward(mx.array([sequence[start : start + size]]), caches)
        chunks.append(model.logits(hidden))
        start += size
    assert start == len(sequence)
    assert relative_error(mx.concatenate(chunks, axis=1), one_shot) <= 1e-4


def test_chunked_calls_match_mlx_lm_chunk_for_chunk(pair):
    """Both sides fed the same chunks through their own caches agree at every position
    (for dynamic NTK RoPE, where chunking changes the result, this is the parity claim)."""
    model, reference = pair
    sequence = PROMPT + PROMPT[::-1]
    caches, their_cache = model.make_caches(), make_prompt_cache(reference)
    start = 0
    for size in (5, 1, 7, 1, 3, 7):
        chunk = mx.array([sequence[start : start + size]])
        got = model.logits(model.forward(chunk, caches)[0])
        assert relative_error(got, reference(chunk, cache=their_cache)) <= 1e-4, start
        start += size
    assert start == len(sequence)


def test_taps_return_the_requested_layer_outputs(pair, monkeypatch):
    model, reference = pair
    last = len(model.layers) - 1
    hidden, tapped = model.forward(mx.array([PROMPT]), taps=(0, last))
    assert sorted(tapped) == [0, last]
    assert mx.array_equal(model.model.norm(tapped[last]), hidden)
    # tap 0 is the first block's output, as mlx-lm's own first block computes it
    _, block_out = first_block_io(reference, mx.array([PROMPT]), monkeypatch)
    assert relative_error(tapped[0], block_out) <= 1e-4


def first_block_io(reference, tokens, monkeypatch):
    """What mlx-lm's first decoder block receives and returns when it runs ``tokens``."""
    first = reference.layers[0]
    seen = []
    real_call = type(first).__call__

    def spy(self, x, *args, **kwargs):
        out = real_call(self, x, *args, **kwargs)
        if self is first and not seen:
            seen.append((x, out[0] if isinstance(out, tuple) else out))
        return out

    monkeypatch.setattr(type(first), "__call__", spy)
    reference(tokens)
    monkeypatch.undo()
    return seen[0]


def test_embed_is_what_the_first_layer_sees(pair, monkeypatch):
    model, reference = pair
    tokens = mx.array([PROMPT[:3]])
    block_in, _ = first_block_io(reference, tokens, monkeypatch)
    assert relative_error(model.embed(tokens), block_in) <= 1e-6
    assert "taps" in model.capabilities and model.vocab_size == model.args.vocab_size
