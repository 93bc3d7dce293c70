"""Tiny random-weight configs of every mlx-lm architecture (:class:`foretell.tools.SyntheticSpec`),
for tests and ``foretell bench --synthetic``.

One table of small sizes serves every family: a config.json holds every key of
:data:`TINY` (mlx-lm's ``ModelArgs.from_dict`` reads the ones its family declares and ignores
the rest), and a wrapper whose text model sits in ``text_config`` gets the same table there.
:data:`FAMILY` adds what a family needs beyond it (layer patterns, expert counts that must
agree, recurrent sizes); a wrapper's own ``text_config`` entry there is laid over its text
model's.
"""

from __future__ import annotations

from typing import Any

from foretell.tools import TOKENIZER_VOCAB, SyntheticSpec
from foretell_mlxlm.zoo import model_types

#: Sizes under every name mlx-lm's families use for them.
TINY: dict[str, Any] = {
    # widths and depths
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "model_dim": 64, "hidden_dim": 64,
    "dim": 64, "intermediate_size": 128, "ffn_hidden_size": 128, "n_inner": 128,
    "ff_intermediate_size": 128, "intermediate_size_mlp": 128, "block_dim": 64,
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2,
    "num_transformer_layers": 2,
    # attention
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "n_kv_heads": 2, "num_attention_groups": 2,
    "head_dim": 16, "attention_bias": False, "use_qk_norm": False,
    "max_position_embeddings": 1024, "n_positions": 1024, "n_ctx": 1024, "block_size": 1024,
    "model_max_length": 1024, "rope_theta": 10000.0, "rotary_emb_base": 10000.0,
    "rope_scaling": None, "partial_rotary_factor": 1.0, "rotary_pct": 1.0,
    # norms and embeddings
    "rms_norm_eps": 1e-5, "norm_eps": 1e-5, "layer_norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5, "layernorm_epsilon": 1e-5,
    "vocab_size": TOKENIZER_VOCAB, "num_vocab": TOKENIZER_VOCAB, "tie_word_embeddings": False,
    # mixtures of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_intermediate_size": 64,
    "expert_ffn_hidden_size": 64, "shared_expert_intermediate_size": 64,
    "shared_intermediate_size": 64, "n_shared_experts": 1, "num_shared_experts": 1,
    "num_shared_expert": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "num_dense_layers": 1, "moe_layer_freq": 1, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": True, "routed_scaling_factor": 1.0,
    # latent attention (DeepSeek-style)
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # recurrent and linear-attention layers
    "state_size": 8, "ssm_state_size": 8, "conv_kernel": 4, "time_step_rank": 8,
    "n_groups": 1, "mamba_num_heads": 4, "mamba_head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4, "conv_L_cache": 3, "conv1d_width": 4,
    "mamba_d_conv": 4, "mamba_d_state": 8, "mamba_expand": 2,
    # switches most families default but some require
    "mlp_bias": False, "use_bias": False, "use_conv_bias": True, "conv_bias": False,
    "use_qkv_bias": False, "qk_norm": False, "post_norm": False, "mamba_proj_bias": False,
    "use_expert_bias": False, "rotary_dim": 8, "kv_channels": 16,
    # layer patterns: every second layer is the other kind, so two layers hold both
    "sliding_window_pattern": 2, "full_attention_interval": 2,
}

_ROPE = {"rope_theta": 10000.0, "rope_type": "default"}
_MISTRAL_ROPE = {**_ROPE, "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 1024}

_TWO = ["full_attention", "sliding_attention"]
#: A text-only Hadamard pack: each MLP's down projection (the one layer made 512 wide,
#: the smallest rotation block) stored 2-bit with its input rotated.
_HADAMARD_PACK = {
    "schema_version": 1, "tensor_namespace": "mlx-lm-text", "gdn_activation_layout": "grouped",
    "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
    "modules": [{"path": f"model.layers.{i}.mlp.down_proj", "embedding": False,
                 "dtype": "float16", "block": 512} for i in range(2)]}
#: Kimi's linear attention on the first layer (numbered from 1), latent attention after.
_KDA = {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 4, "head_dim": 16,
        "short_conv_kernel_size": 4}

#: What a family needs beyond :data:`TINY`.
FAMILY: dict[str, dict[str, Any]] = {
    "afm7": {"num_kv_reuse_layers": 1},
    "afmoe": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
    "baichuan_m1": {"sliding_window": 8, "sliding_window_layers": [1], "conv_window": 2},
    "bailing_hybrid": {"layer_group_size": 2, "group_norm_size": 1},
    "bailing_moe_linear": {"layer_group_size": 2, "group_norm_size": 1},
    "dbrx": {"ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "exaone4": {"sliding_window": 8, "sliding_window_pattern": "LG"},
    "exaone_moe": {"sliding_window": 8, "layer_types": _TWO, "is_moe_layer": [False, True]},
    "gear": {"layer_types": _TWO, "sliding_window": 8},
    "glm_moe_dsa": {"index_head_dim": 16, "index_n_heads": 2, "index_topk": 4,
                    "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
    "granite": {"logits_scaling": 1.0, "attention_multiplier": 0.25,
                "embedding_multiplier": 1.0, "residual_multiplier": 1.0},
    "granitemoe": {"logits_scaling": 1.0, "attention_multiplier": 0.25,
                   "embedding_multiplier": 1.0, "residual_multiplier": 1.0},
    "granitemoehybrid": {"logits_scaling": 1.0, "attention_multiplier": 0.25,
                         "embedding_multiplier": 1.0, "residual_multiplier": 1.0,
                         "layer_types": ["mamba", "attention"], "mamba_n_heads": 4,
                         "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_conv_bias": True},
    # the second layer reuses the first's keys and values (cross-layer attention)
    "hunyuan": {"use_mixed_mlp_moe": True, "use_cla": True, "cla_share_factor": 2,
                "use_qk_norm": True, "rope_scaling": {"alpha": 1000.0, "factor": 1.0,
                                                      "type": "dynamic"}},
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
              "expert_layer_period": 2},
    # the first layer Kimi delta attention (recurrent), the second latent attention
    "kimi_linear": {"linear_attn_config": _KDA, "mla_use_nope": True,
                    "num_experts_per_token": 2, "num_shared_experts": 1},
    "kimi_k3": {"linear_attn_config": _KDA, "num_experts_per_token": 2,
                "num_shared_experts": 1, "attn_res_block_size": 1,
                "activation_situ_beta": 4.0, "activation_situ_linear_beta": 8.0},
    "lfm2": {"block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": False, "full_attn_idxs": [1]},
    "lfm2_moe": {"full_attn_idxs": [1]},
    "llama4_text": {"no_rope_layers": [1, 0]},
    "longcat_flash": {"attention_method": "MLA", "zero_expert_type": "identity",
                      "zero_expert_num": 1, "mla_scale_q_lora": True,
                      "mla_scale_kv_lora": True},
    "longcat_flash_ngram": {"zero_expert_num": 1, "mla_scale_q_lora": True,
                            "mla_scale_kv_lora": True},
    "mamba2": {"time_step_limit": [0.0, 1e9]},
    "mellum": {"layer_types": _TWO, "sliding_window": 8,
               "rope_parameters": {"full_attention": _ROPE, "sliding_attention": _ROPE}},
    # a global layer, then a sliding one with attention sinks and experts
    "mimo_v2_flash": {"hybrid_layer_pattern": [0, 1], "moe_layer_freq": [0, 1],
                      "add_swa_attention_sink_bias": True,
                      "add_full_attention_sink_bias": False, "sliding_window_size": 4,
                      "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                      "swa_rope_theta": 10000.0, "swa_num_attention_heads": 4,
                      "swa_num_key_value_heads": 2, "swa_head_dim": 16,
                      "swa_v_head_dim": 16},
    "minicpm": {"dim_model_base": 64, "scale_depth": 1.0, "scale_emb": 1.0},
    "minicpm3": {"dim_model_base": 64, "scale_depth": 1.0, "scale_emb": 1.0,
                 "rope_scaling": {"type": "longrope", "original_max_position_embeddings": 512,
                                  "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}},
    "nemotron": {"hidden_act": "relu2"},
    # one block of each kind the search produces: attention and MLP, attention skipped
    # with a linear MLP, attention replaced by a linear map with the MLP skipped
    "nemotron-nas": {"num_hidden_layers": 3, "hidden_act": "silu", "block_configs": [
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"no_op": True}, "ffn": {"replace_with_linear": True}},
        {"attention": {"replace_with_linear": True}, "ffn": {"no_op": True}}]},
    "olmo": {"mlp_hidden_size": 256, "embedding_size": TOKENIZER_VOCAB},
    "olmo_hybrid": {"linear_allow_neg_eigval": False},
    "openelm": {"ffn_dim_divisor": 16, "num_query_heads": [4, 4], "num_kv_heads": [2, 2],
                "ffn_multipliers": [1.0, 1.0]},
    # its head masks token ids up to 100351 (mlx-lm writes -inf there), so the vocabulary
    # must reach them; blocks of 32 with two local ones (mlx-lm allows 32 or 64)
    "phi3small": {"dense_attention_every_n_layers": 2, "gegelu_limit": 20.0,
                  "vocab_size": 100352, "blocksparse_block_size": 32,
                  "blocksparse_num_local_blocks": 2, "blocksparse_vert_stride": 2},
    # its key heads are tiled n_shared_head times to meet the query heads
    "plamo": {"n_shared_head": 2},
    "recurrent_gemma": {"logits_soft_cap": 30.0, "attention_window_size": 8,
                        "block_types": ["recurrent", "attention"]},
    "rwkv7": {"a_low_rank_dim": 8, "v_low_rank_dim": 8, "gate_low_rank_dim": 8,
              "decay_low_rank_dim": 8},
    "spark2_5": {"sliding_window": 8,
                 "rope_parameters": {"full_attention": _ROPE, "sliding_attention": _ROPE}},
    "step3p5": {"moe_top_k": 2, "moe_num_experts": 4},
    "cohere2": {"sliding_window": 8},
    "deepseek_v2": {"rope_scaling": {"type": "yarn", "factor": 1.0, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                     "original_max_position_embeddings": 1024}},
    "gemma3_text": {"sliding_window": 8},
    "ministral3": {"rope_parameters": _MISTRAL_ROPE},
    "mistral4": {"rope_parameters": _MISTRAL_ROPE},
    "nemotron_h": {"hybrid_override_pattern": "M*"},
    "olmo3": {"layer_types": _TWO, "sliding_window": 8},
    "qwen3_5": {"text_model_type": "qwen3_5_text"},
    "prism_hadamard_qwen35": {"text_model_type": "qwen3_5_text", **_HADAMARD_PACK,
                              "text_config": {"num_experts": 0, "intermediate_size": 512}},
    "qwen3_5_moe": {"text_model_type": "qwen3_5_moe_text"},
    # wrappers whose text model reads text_config
    "gemma3": {"text_model_type": "gemma3_text"},
    "gemma4": {"text_model_type": "gemma4_text"},
    "gemma4_text": {"sliding_window": 8, "layer_types": _TWO, "num_kv_shared_layers": 0,
                    "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 512},
    # three layers, the third sharing the first's KV; the first MLP sparse (top-k gelu)
    "gemma3n": {"text_model_type": "gemma3n_text", "text_config": {
        "num_hidden_layers": 3, "num_kv_shared_layers": 1, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "activation_sparsity_pattern": [0.95, 0.0, 0.0], "vocab_size_per_layer_input": 256,
        "hidden_size_per_layer_input": 8, "rope_local_base_freq": 10000.0,
        "final_logit_softcapping": 30.0, "altup_num_inputs": 2, "altup_coef_clip": 120.0,
        "altup_correct_scale": True, "altup_active_idx": 0, "laurel_rank": 8}},
    "kimi_k25": {"text_model_type": "deepseek_v3"},
    "kimi_vl": {"text_model_type": "deepseek_v3"},
    "lfm2-vl": {"text_model_type": "lfm2"},
    # every fourth layer attends globally, the others in chunks the prompt crosses
    "llama4": {"text_model_type": "llama4_text", "text_config": {
        "num_hidden_layers": 4, "attention_chunk_size": 4, "interleave_moe_layer_step": 2,
        "num_experts_per_tok": 1, "use_qk_norm": True}},
    # a dense global layer, then a sparse-attention MoE layer whose indexer keeps two
    # blocks of two keys, the local one among them (the fifth token's query drops one)
    "minimax_m3_vl": {"text_model_type": "minimax_m3", "text_config": {
        "moe_layer_freq": [0, 1], "layer_types": ["full_attention", "sparse_attention"],
        "index_n_heads": 2, "index_head_dim": 16, "index_block_size": 2,
        "index_topk_blocks": 2, "index_local_blocks": 1, "dense_intermediate_size": 128}},
    "mistral3": {"text_model_type": "ministral3", "rope_parameters": _MISTRAL_ROPE},
    "muse_spark": {"text_model_type": "muse_spark_text", "text_config": {
        "post_norm_eps": 1e-5, "rope_parameters": _ROPE, "layer_rope_theta": [10000.0, 0.0],
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
        "final_logit_softcapping": 30.0, "output_multiplier": 1.0, "moe_hidden_size": 32,
        "num_shared_experts": 0, "mlp_layer_types": ["sparse", "sparse"]}},
    "pixtral": {"text_model_type": "llama"},
    "qwen3_vl_moe": {"text_model_type": "qwen3_moe"},
}


def config_for(model_type: str) -> dict[str, Any]:
    """A tiny ``config.json`` dict for ``model_type``."""
    config = {**TINY, **FAMILY.get(model_type, {})}
    text = config.pop("text_model_type", None)
    text_extra = config.pop("text_config", {})
    if text is not None:
        config["text_config"] = {**TINY, **FAMILY.get(text, {}), **text_extra,
                                 "model_type": text}
    config["model_type"] = model_type
    return config


def spec_for(model_type: str) -> SyntheticSpec:
    return SyntheticSpec(config=config_for(model_type))


def __getattr__(name: str) -> SyntheticSpec:
    # One spec per model_type, named as foretell_mlxlm.spec_name() names them.
    if name.startswith("spec_"):
        from foretell_mlxlm import spec_name

        for model_type in model_types():
            if spec_name(model_type) == name:
                return spec_for(model_type)
    raise AttributeError(name)
