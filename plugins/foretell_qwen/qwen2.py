"""Qwen2 / Qwen2.5: the Qwen3 stack (:mod:`foretell_qwen.qwen3`) with biases on the
q/k/v projections, no q/k norms, and a head width derived from the hidden size."""

from __future__ import annotations

from typing import Any

import attrs

from foretell.model import args_from_config, make_rope, require_divides
from foretell_qwen.qwen3 import QwenModel


@attrs.frozen(kw_only=True)
class Qwen2Args:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rope_traditional: bool = False
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = True


def build(config: dict[str, Any]) -> QwenModel:
    args = args_from_config(Qwen2Args, config)
    require_divides(args, "num_attention_heads", "hidden_size")
    # Like mlx-lm, the head width is hidden_size / heads; a head_dim field is ignored.
    head_dim = args.hidden_size // args.num_attention_heads
    rope = make_rope(
        head_dim,
        base=args.rope_theta,
        traditional=args.rope_traditional,
        scaling=args.rope_scaling,
        max_position_embeddings=args.max_position_embeddings,
    )
    return QwenModel(args, head_dim=head_dim, qk_norm=False, bias=True, rope=rope)
