"""Gemma 3 (text): a pre/post-norm decoder that interleaves sliding-window layers with
global ones (every ``sliding_window_pattern``-th layer is global), each with its own
RoPE base. RMSNorm weights are stored as offsets from one, embeddings are scaled by
sqrt(hidden) (rounded to bfloat16, as the reference does), attention is scaled by
``query_pre_attn_scalar`` and the MLP is GeGLU.

Interpretation of config.json follows mlx-lm's gemma3_text (the numerical oracle).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from foretell.model import (
    PORT_TAPS,
    KVCache,
    RotatingKVCache,
    args_from_config,
    attend,
    attention_mask,
    make_rope,
    require_divides,
)
from foretell_gemma.layers import MLP


@attrs.frozen(kw_only=True)
class Gemma3Args:
    model_type: str
    hidden_size: int = 1152
    num_hidden_layers: int = 26
    intermediate_size: int = 6912
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    vocab_size: int = 262144
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_scaling: dict | None = None
    query_pre_attn_scalar: float = 256.0
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    max_position_embeddings: int = 32768

    def is_global(self, layer: int) -> bool:
        return layer % self.sliding_window_pattern == self.sliding_window_pattern - 1


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: the stored weight is an offset from one."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


@partial(mx.compile, shapeless=True)
def add_residual(x: mx.array, y: mx.array) -> mx.array:
    # float16 overflows on Gemma's residual stream; add in float32 and clip, as the
    # reference does, so fp16 checkpoints produce finite outputs.
    if x.dtype != mx.float16:
        return x + y
    bound = mx.finfo(mx.float16).max
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -bound, bound).astype(mx.float16)


class Attention(nn.Module):
    def __init__(self, args: Gemma3Args, layer: int):
        super().__init__()
        dim, head_dim = args.hidden_size, args.head_dim
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.scale = args.query_pre_attn_scalar**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, args.rms_norm_eps)
        if args.is_global(layer):
            self.rope = make_rope(
                head_dim,
                base=args.rope_theta,
                scaling=args.rope_scaling,
                max_position_embeddings=args.max_position_embeddings,
            )
        else:
            # Sliding layers use the local base and never the long-context scaling.
            self.rope = make_rope(head_dim, base=args.rope_local_base_freq)

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries, keys = self.q_norm(queries), self.k_norm(keys)
        offset = 0 if cache is None else cache.offset
        queries, keys = self.rope(queries, offset), self.rope(keys, offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        out = attend(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: Gemma3Args, layer: int):
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(dim, args.intermediate_size)
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = add_residual(x, self.post_attention_layernorm(r))
        r = self.mlp(self.pre_feedforward_layernorm(h))
        return add_residual(h, self.post_feedforward_layernorm(r))


class Body(nn.Module):
    """The ``model.*`` subtree of the checkpoint."""

    def __init__(self, args: Gemma3Args):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Gemma3Text(nn.Module):
    """Gemma 3 text decoder implementing :class:`foretell.model.Model`."""

    capabilities = frozenset({PORT_TAPS})

    def __init__(self, args: Gemma3Args):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.vocab_size = args.vocab_size
        self.model = Body(args)
        # Whether the head is tied is read from the checkpoint (see sanitize).
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tied = False
        self.global_layers = [i for i in range(args.num_hidden_layers) if args.is_global(i)]
        self.sliding_layers = [i for i in range(args.num_hidden_layers) if not args.is_global(i)]

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def make_caches(self) -> list[Any]:
        return [
            KVCache() if self.args.is_global(i) else RotatingKVCache(self.args.sliding_window)
            for i in range(self.args.num_hidden_layers)
        ]

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.model.embed_tokens(tokens)
        # The reference rounds the scale to bfloat16 before applying it.
        return h * mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)

    def forward(
        self, tokens: mx.array, caches: list[Any] | None = None, taps: Sequence[int] = ()
    ) -> tuple[mx.array, dict[int, mx.array]]:
        h = self.embed(tokens)
        n = tokens.shape[1]
        caches = caches or [None] * len(self.model.layers)
        window = self.args.sliding_window
        global_mask = (
            attention_mask(n, caches[self.global_layers[0]]) if self.global_layers else None
        )
        sliding_mask = (
            attention_mask(n, caches[self.sliding_layers[0]], window)
            if self.sliding_layers
            else None
        )
        tapped = {}
        for i, (layer, cache) in enumerate(zip(self.model.layers, caches)):
            mask = global_mask if self.args.is_global(i) else sliding_mask
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
        # Gemma 3 checkpoints tie the head by leaving lm_head out.
        if "lm_head.weight" not in weights and "lm_head" in self:
            self.tied = True
            self.pop("lm_head")
        return {n: w for n, w in weights.items() if "rotary_emb.inv_freq" not in n}


def build(config: dict[str, Any]) -> Gemma3Text:
    args = args_from_config(Gemma3Args, config)
    require_divides(args, "num_key_value_heads", "num_attention_heads")
    if args.sliding_window_pattern < 1 or args.sliding_window < 1:
        raise ValueError("fields 'sliding_window' and 'sliding_window_pattern' must be positive")
    return Gemma3Text(args)
