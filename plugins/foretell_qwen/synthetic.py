"""Tiny random-weight Qwen checkpoints for tests and ``foretell bench --synthetic``.

Registered as the architectures' ``synthetic=`` spec; imported only when one is made.
"""

from foretell.tools import TOKENIZER_VOCAB, SyntheticSpec

#: Named Qwen3 shapes. 30m/150m are the shapes of the project's CPU anchor figures; 0.6b
#: and 4b are the real Qwen3-0.6B / Qwen3-4B shapes (random weights).
QWEN3_PRESETS = {
    "30m": {
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "intermediate_size": 1536,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 32000,
    },
    "150m": {
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "intermediate_size": 3584,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 32000,
    },
    "0.6b": {
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
    },
    "4b": {
        "hidden_size": 2560,
        "num_hidden_layers": 36,
        "intermediate_size": 9728,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
    },
}

QWEN3 = SyntheticSpec(
    config={
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": TOKENIZER_VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "float32",
    },
    presets=QWEN3_PRESETS,
)

QWEN2 = SyntheticSpec(
    config={
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": TOKENIZER_VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "sliding_window": 32768,
        "use_sliding_window": False,
        "torch_dtype": "float32",
    },
)
