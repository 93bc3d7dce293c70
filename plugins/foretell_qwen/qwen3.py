"""Qwen3: a dense pre-norm decoder with grouped-query attention, RMSNorm on each query
and key head, RoPE and a SwiGLU MLP. Qwen2 (:mod:`foretell_qwen.qwen2`) is the same stack
with q/k/v biases and no q/k norms, so the modules here take those as switches.

Parameter names are the checkpoint's (``model.layers.N.self_attn.q_proj.weight`` ...),
so mlx-lm and foretell read the same files.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from foretell.model import (
    PORT_MTP,
    PORT_TAPS,
    KVCache,
    args_from_config,
    attend,
    attention_mask,
    make_rope,
    require_divides,
)


@attrs.frozen(kw_only=True)
class Qwen3Args:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    # transformers >= 5 nests rope_theta / rope_scaling here.
    rope_parameters: dict | None = None

    @property
    def rope_base(self) -> float:
        base = self.rope_theta
        if base is None and self.rope_parameters:
            base = self.rope_parameters.get("rope_theta")
        if base is None:
            raise ValueError("field 'rope_theta': missing (nor found in rope_parameters)")
        return float(base)

    @property
    def rope_config(self) -> dict | None:
        return self.rope_scaling if self.rope_scaling is not None else self.rope_parameters


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


class Attention(nn.Module):
    def __init__(self, args: Any, *, head_dim: int, qk_norm: bool, bias: bool, rope: Any):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=False)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.rope = rope

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self.qk_norm:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
        offset = 0 if cache is None else cache.offset
        queries, keys = self.rope(queries, offset), self.rope(keys, offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        out = attend(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: Any, attention: Attention):
        super().__init__()
        self.self_attn = attention
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Body(nn.Module):
    """The ``model.*`` subtree of the checkpoint."""

    def __init__(self, args: Any, layers: list[DecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = layers
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class QwenModel(nn.Module):
    """A Qwen-family decoder implementing :class:`foretell.model.Model`."""

    capabilities = frozenset({PORT_TAPS})

    def __init__(self, args: Any, *, head_dim: int, qk_norm: bool, bias: bool, rope: Any):
        super().__init__()
        require_divides(args, "num_key_value_heads", "num_attention_heads")
        self.args = args
        self.model_type = args.model_type
        self.vocab_size = args.vocab_size
        self.tied = args.tie_word_embeddings
        layers = [
            DecoderLayer(
                args, Attention(args, head_dim=head_dim, qk_norm=qk_norm, bias=bias, rope=rope)
            )
            for _ in range(args.num_hidden_layers)
        ]
        self.model = Body(args, layers)
        if not self.tied:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def make_caches(self) -> list[KVCache]:
        return [KVCache() for _ in self.model.layers]

    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.embed_tokens(tokens)

    def forward(
        self, tokens: mx.array, caches: list[Any] | None = None, taps: Sequence[int] = ()
    ) -> tuple[mx.array, dict[int, mx.array]]:
        h = self.model.embed_tokens(tokens)
        caches = caches or [None] * len(self.model.layers)
        mask = attention_mask(tokens.shape[1], caches[0])
        tapped = {}
        for i, (layer, cache) in enumerate(zip(self.model.layers, caches)):
            h = layer(h, mask, cache)
            if taps and i in taps:
                tapped[i] = h
        return self.model.norm(h), tapped

    def logits(self, hidden: mx.array) -> mx.array:
        if self.tied:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def __call__(self, tokens: mx.array, caches: list[Any] | None = None) -> mx.array:
        return self.logits(self.forward(tokens, caches)[0])

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # Tied checkpoints sometimes still carry lm_head; HF exports may carry RoPE tables.
        return {
            name: w
            for name, w in weights.items()
            if not (self.tied and name.startswith("lm_head.")) and "rotary_emb.inv_freq" not in name
        }


def build(config: dict[str, Any]) -> QwenModel:
    args = args_from_config(Qwen3Args, config)
    rope = make_rope(
        args.head_dim,
        base=args.rope_base,
        scaling=args.rope_config,
        max_position_embeddings=args.max_position_embeddings,
    )
    model = QwenModel(args, head_dim=args.head_dim, qk_norm=True, bias=False, rope=rope)
    if isinstance(config.get("mtp_config"), dict):
        # The checkpoint declares an MTP head beside its weights (foretell_qwen.mtp reads it).
        model.capabilities = QwenModel.capabilities | {PORT_MTP}
    return model
