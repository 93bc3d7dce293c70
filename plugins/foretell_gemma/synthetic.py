"""Tiny random-weight Gemma checkpoints for tests and ``foretell bench --synthetic``.

Registered as the architectures' ``synthetic=`` spec; imported only when one is made.
"""

from typing import Any

from foretell.tools import TOKENIZER_VOCAB, SyntheticSpec

GEMMA3_TEXT = SyntheticSpec(
    config={
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "vocab_size": TOKENIZER_VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "max_position_embeddings": 32768,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    },
    # Gemma 3 stores RMSNorm weights as offsets from one (the norm multiplies by 1 + w).
    norm_offset=1.0,
)

_GEMMA4_PATTERN = ["sliding_attention", "sliding_attention", "full_attention"]


def _gemma4_layer_types(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    # One layer type per layer: a changed layer count keeps the sliding/sliding/full pattern.
    if "layer_types" not in overrides:
        layers = config["num_hidden_layers"]
        config["layer_types"] = (_GEMMA4_PATTERN * (layers // 3 + 1))[:layers]
    return config


GEMMA4_TEXT = SyntheticSpec(
    config={
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 16,
        "vocab_size": TOKENIZER_VOCAB,
        "vocab_size_per_layer_input": TOKENIZER_VOCAB,
        "rms_norm_eps": 1e-6,
        "sliding_window": 8,
        "layer_types": _GEMMA4_PATTERN * 2,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1_000_000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
        },
        "final_logit_softcapping": 30.0,
        "use_double_wide_mlp": True,
        "attention_k_eq_v": False,
        "enable_moe_block": False,
        "max_position_embeddings": 131072,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    },
    finalize=_gemma4_layer_types,
)
