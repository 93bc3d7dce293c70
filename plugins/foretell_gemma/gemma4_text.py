"""Gemma 4 (text, dense): Gemma's pre/post-norm decoder with per-layer-type attention.

What sets it apart, read from config.json as mlx-lm's gemma4_text does: ``layer_types``
mixes sliding and full layers, each type with its own RoPE (full layers may be wider and
rotate only part of each head); the last ``num_kv_shared_layers`` layers reuse the keys and
values of the last earlier layer of their type; per-layer input embeddings gate an extra
input into every layer; queries, keys and values are RMS-normed, attention is unscaled,
layer outputs are scaled by a learned scalar, logits soft-capped; ``attention_k_eq_v``
reuses the key projection as values on full layers. The mixture-of-experts variant is
refused at build time.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from foretell.errors import ModelLoadError
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
from foretell_gemma.layers import MLP, geglu

SLIDING, FULL = "sliding_attention", "full_attention"

_DEFAULT_ROPE = {
    FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0, "rope_type": "proportional"},
    SLIDING: {"partial_rotary_factor": 1.0, "rope_theta": 10_000.0, "rope_type": "default"},
}


@attrs.frozen(kw_only=True)
class Gemma4Args:
    model_type: str = "gemma4_text"
    hidden_size: int = 1536
    num_hidden_layers: int = 35
    intermediate_size: int = 6144
    num_attention_heads: int = 8
    head_dim: int = 256
    global_head_dim: int | None = 512
    rms_norm_eps: float = 1e-6
    vocab_size: int = 262144
    vocab_size_per_layer_input: int = 262144
    num_key_value_heads: int = 1
    num_global_key_value_heads: int | None = None
    num_kv_shared_layers: int = 20
    hidden_size_per_layer_input: int | None = 256
    rope_traditional: bool = False
    rope_parameters: dict | None = None
    sliding_window: int = 512
    sliding_window_pattern: int = 5
    max_position_embeddings: int = 131072
    attention_k_eq_v: bool = False
    final_logit_softcapping: float | None = 30.0
    use_double_wide_mlp: bool = True
    enable_moe_block: bool = False
    num_experts: int | None = None
    layer_types: list | None = None
    tie_word_embeddings: bool = True

    @property
    def types(self) -> list[str]:
        if self.layer_types is not None:
            return list(self.layer_types)
        pattern = [SLIDING] * (self.sliding_window_pattern - 1) + [FULL]
        return (pattern * (self.num_hidden_layers // len(pattern) + 1))[: self.num_hidden_layers]

    @property
    def first_shared(self) -> int:
        """Index of the first layer that borrows keys/values instead of computing them."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    def rope_for(self, layer_type: str) -> dict:
        return (self.rope_parameters or _DEFAULT_ROPE).get(layer_type, {})


@partial(mx.compile, shapeless=True)
def soft_cap(cap: float, x: mx.array) -> mx.array:
    return mx.tanh(x / cap) * cap


class Attention(nn.Module):
    def __init__(self, args: Gemma4Args, layer: int):
        super().__init__()
        layer_type = args.types[layer]
        full = layer_type == FULL
        self.head_dim = head_dim = (
            args.global_head_dim if full and args.global_head_dim else args.head_dim
        )
        self.k_eq_v = args.attention_k_eq_v and full
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = (
            args.num_global_key_value_heads
            if self.k_eq_v and args.num_global_key_value_heads is not None
            else args.num_key_value_heads
        )
        self.owns_kv = layer < args.first_shared
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=eps)
        if self.owns_kv:
            self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
            self.k_norm = nn.RMSNorm(head_dim, eps=eps)
        self.eps = eps
        rope = args.rope_for(layer_type)
        self.rope = make_rope(
            head_dim,
            base=float(rope.get("rope_theta", 10_000.0)),
            traditional=args.rope_traditional,
            scaling=rope,
            max_position_embeddings=args.max_position_embeddings,
            field=f"rope_parameters.{layer_type}",
        )

    def __call__(
        self, x: mx.array, mask: Any, cache: Any, shared: tuple | None
    ) -> tuple[mx.array, tuple]:
        """Returns the output and ``(keys, values, offset)`` for layers that share them."""
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim))
        if shared is not None:
            keys, values, offset = shared
        else:
            offset = 0 if cache is None else cache.offset
            keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            values = keys if self.k_eq_v else self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)
            keys = self.rope(self.k_norm(keys).transpose(0, 2, 1, 3), offset)
            values = mx.fast.rms_norm(values, None, self.eps).transpose(0, 2, 1, 3)
            if cache is not None:
                keys, values = cache.update_and_fetch(keys, values)
        queries = self.rope(queries.transpose(0, 2, 1, 3), offset)
        out = attend(queries, keys, values, scale=1.0, mask=mask)
        out = self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
        return out, (keys, values, offset)


class DecoderLayer(nn.Module):
    def __init__(self, args: Gemma4Args, layer: int):
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, layer)
        shared = layer >= args.first_shared > 0
        wide = 2 if args.use_double_wide_mlp and shared else 1
        self.mlp = MLP(dim, args.intermediate_size * wide)
        self.input_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
        self.per_layer_input = bool(args.hidden_size_per_layer_input)
        if self.per_layer_input:
            width = args.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(dim, width, bias=False)
            self.per_layer_projection = nn.Linear(width, dim, bias=False)
            self.post_per_layer_input_norm = nn.RMSNorm(dim, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(
        self, x: mx.array, mask: Any, cache: Any, extra: mx.array | None, shared: tuple | None
    ) -> tuple[mx.array, tuple]:
        r, kv = self.self_attn(self.input_layernorm(x), mask, cache, shared)
        h = x + self.post_attention_layernorm(r)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if extra is not None:
            gate = geglu(self.per_layer_input_gate(h), extra)
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self.layer_scalar, kv


class Body(nn.Module):
    """The ``model.*`` subtree of the checkpoint."""

    def __init__(self, args: Gemma4Args):
        super().__init__()
        dim = args.hidden_size
        self.embed_tokens = nn.Embedding(args.vocab_size, dim)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(dim, eps=args.rms_norm_eps)
        if args.hidden_size_per_layer_input:
            width = args.num_hidden_layers * args.hidden_size_per_layer_input
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, width)
            self.per_layer_model_projection = nn.Linear(dim, width, bias=False)
            self.per_layer_projection_norm = nn.RMSNorm(
                args.hidden_size_per_layer_input, eps=args.rms_norm_eps
            )


class Gemma4Text(nn.Module):
    """Gemma 4 dense text decoder implementing :class:`foretell.model.Model`."""

    capabilities = frozenset({PORT_TAPS})

    def __init__(self, args: Gemma4Args):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.vocab_size = args.vocab_size
        self.model = Body(args)
        self.tied = args.tie_word_embeddings
        if not self.tied:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        types = args.types
        self.layer_types = types
        self.embed_scale = args.hidden_size**0.5
        # A shared layer reads the keys/values of the last earlier owner of its type.
        last_owner: dict[str, int] = {}
        self.kv_source: list[int] = []
        for i, layer_type in enumerate(types):
            if i < args.first_shared:
                last_owner[layer_type] = i
                self.kv_source.append(i)
            elif layer_type not in last_owner:
                raise ValueError(
                    f"field 'num_kv_shared_layers': layer {i} ({layer_type}) shares keys/"
                    "values but no earlier layer of that type computes them"
                )
            else:
                self.kv_source.append(last_owner[layer_type])
        # Masks come from the first cache of each type (every cache of a type agrees).
        self.first_of_type = {t: types.index(t) for t in (SLIDING, FULL) if t in types}

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def make_caches(self) -> list[Any]:
        """One cache per layer that computes keys/values (the shared layers own none)."""
        return [
            KVCache() if t == FULL else RotatingKVCache(self.args.sliding_window)
            for t in self.layer_types[: self.args.first_shared]
        ]

    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.embed_tokens(tokens) * self.embed_scale

    def _per_layer_inputs(self, tokens: mx.array, h: mx.array) -> mx.array:
        """``[B, L, layers, width]``: token-specific embeddings mixed with a projection of
        the (scaled) input embedding."""
        args, body = self.args, self.model
        shape = (args.num_hidden_layers, args.hidden_size_per_layer_input)
        by_token = body.embed_tokens_per_layer(tokens) * args.hidden_size_per_layer_input**0.5
        projected = body.per_layer_model_projection(h) * args.hidden_size**-0.5
        projected = body.per_layer_projection_norm(mx.unflatten(projected, -1, shape))
        return (projected + mx.unflatten(by_token, -1, shape)) * 2.0**-0.5

    def forward(
        self, tokens: mx.array, caches: list[Any] | None = None, taps: Sequence[int] = ()
    ) -> tuple[mx.array, dict[int, mx.array]]:
        h = self.embed(tokens)
        n_layers = len(self.model.layers)
        extra = self._per_layer_inputs(tokens, h) if self.args.hidden_size_per_layer_input else None
        caches = list(caches or [])
        caches += [None] * (n_layers - len(caches))
        masks = {
            FULL: attention_mask(tokens.shape[1], caches[self.first_of_type[FULL]])
            if FULL in self.first_of_type
            else None,
            SLIDING: attention_mask(
                tokens.shape[1], caches[self.first_of_type[SLIDING]], self.args.sliding_window
            )
            if SLIDING in self.first_of_type
            else None,
        }
        kvs: list[tuple | None] = [None] * n_layers
        tapped = {}
        for i, layer in enumerate(self.model.layers):
            source = self.kv_source[i]
            h, kvs[i] = layer(
                h,
                masks[self.layer_types[i]],
                caches[i],
                None if extra is None else extra[:, :, i, :],
                kvs[source] if source != i else None,
            )
            if taps and i in taps:
                tapped[i] = h
        return self.model.norm(h), tapped

    def logits(self, hidden: mx.array) -> mx.array:
        if self.tied:
            out = self.model.embed_tokens.as_linear(hidden)
        else:
            out = self.lm_head(hidden)
        cap = self.args.final_logit_softcapping
        return out if cap is None else soft_cap(cap, out)

    def __call__(self, tokens: mx.array, caches: list[Any] | None = None) -> mx.array:
        return self.logits(self.forward(tokens, caches)[0])

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        dropped = ("self_attn.rotary_emb", "input_max", "input_min", "output_max", "output_min")
        shared_kv = (".self_attn.k_proj.", ".self_attn.v_proj.", ".self_attn.k_norm.")
        kept = {}
        for name, w in weights.items():
            if any(s in name for s in dropped):
                continue
            if self.tied and name.startswith("lm_head."):
                continue
            # Shared layers compute no keys/values; checkpoints may still carry them.
            if any(s in name for s in shared_kv) and _layer_index(name) >= self.args.first_shared:
                continue
            kept[name] = w
        return kept


def _layer_index(name: str) -> int:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return -1


def build(config: dict[str, Any]) -> Gemma4Text:
    if config.get("enable_moe_block") or config.get("num_experts"):
        raise ModelLoadError(
            "field 'enable_moe_block' / 'num_experts': Gemma 4 mixture-of-experts models are "
            "not supported yet (only the dense variants are)"
        )
    args = args_from_config(Gemma4Args, config)
    require_divides(args, "num_key_value_heads", "num_attention_heads")
    if len(args.types) != args.num_hidden_layers or set(args.types) - {SLIDING, FULL}:
        raise ValueError(
            f"field 'layer_types': expected {args.num_hidden_layers} entries, each "
            f"'{SLIDING}' or '{FULL}'"
        )
    if not 0 <= args.num_kv_shared_layers < args.num_hidden_layers:
        raise ValueError("field 'num_kv_shared_layers': must be below num_hidden_layers")
    return Gemma4Text(args)
