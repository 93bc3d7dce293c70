"""Compact torch implementations of the Qwen3 and Gemma-3-text decoders.

Parameter names equal the Hugging Face ones (``model.layers.N.self_attn.q_proj.weight``
...), so a state dict exports as-is; numerics follow transformers/mlx-lm (RMSNorm in
float32, rotate-half RoPE, q/k norms before RoPE, Gemma's (1 + w) norms, sqrt(H) embedding
scale rounded to bf16 as mlx-lm does, and sliding-window layers that attend to the last
``window`` positions including the current one).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelSpec:
    arch: str  # "qwen3" | "gemma3_text"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10_000.0
    local_rope_theta: float = 10_000.0  # gemma sliding layers
    sliding_window: int = 256  # gemma
    sliding_window_pattern: int = 3  # gemma: every Nth layer is global
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    layer_types: list[str] = field(default_factory=list)

    def __post_init__(self):
        if not self.layer_types:
            if self.arch == "gemma3_text":
                p = self.sliding_window_pattern
                self.layer_types = [
                    "full_attention" if (i + 1) % p == 0 else "sliding_attention"
                    for i in range(self.num_layers)
                ]
            else:
                self.layer_types = ["full_attention"] * self.num_layers

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, gemma: bool = False):
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (xf * (1.0 + self.weight.float())).type_as(x)
        return self.weight * xf.type_as(x)


def rope_tables(head_dim: int, base: float, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    rotated = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        gemma = s.arch == "gemma3_text"
        self.nh, self.nkv, self.hd = s.num_heads, s.num_kv_heads, s.head_dim
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps, gemma)
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps, gemma)
        # gemma: query_pre_attn_scalar == head_dim, so both scale by head_dim ** -0.5
        self.scale = s.head_dim**-0.5

    def qkv(self, x, cos, sin):
        """Queries [B, heads, T, D] and keys, values [B, kv heads, T, D], normed and rotated."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q, k, v, mask):
        """The attention block's output (through ``o_proj``); ``mask`` None is causal, else
        a boolean [T, S] of the keys each query may read."""
        B, _, T, _ = q.shape
        if self.nkv != self.nh:
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))

    def forward(self, x, cos, sin, mask, earlier=None):
        """``earlier``: a list of the (keys, values) of this layer's earlier calls (a chained
        head's steps), which the queries also read, before this call's own keys (``mask``
        then spans all of them); this call's are appended to it."""
        q, k, v = self.qkv(x, cos, sin)
        if earlier is not None:
            earlier.append((k, v))
            k = torch.cat([keys for keys, _ in earlier], dim=2)
            v = torch.cat([values for _, values in earlier], dim=2)
        return self.attend(q, k, v, mask)


class MLP(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.gemma = s.arch == "gemma3_text"
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x):
        g = self.gate_proj(x)
        g = F.gelu(g, approximate="tanh") if self.gemma else F.silu(g)
        return self.down_proj(g * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.gemma = s.arch == "gemma3_text"
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, self.gemma)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, self.gemma)
        if self.gemma:
            self.pre_feedforward_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, True)
            self.post_feedforward_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, True)

    def forward(self, x, cos, sin, mask=None, earlier=None):
        """``earlier``: see :meth:`Attention.forward`."""
        if self.gemma:
            x = x + self.post_attention_layernorm(
                self.self_attn(self.input_layernorm(x), cos, sin, mask, earlier)
            )
            return x + self.post_feedforward_layernorm(
                self.mlp(self.pre_feedforward_layernorm(x))
            )
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, earlier)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps, s.arch == "gemma3_text")


class CausalLM(nn.Module):
    """Decoder with tied embeddings. ``hidden`` returns the final-normed hidden states
    (what the LM head consumes); ``logits`` applies the tied head."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec)
        if spec.arch == "gemma3_text":
            # mlx-lm (and transformers in bf16) multiply by sqrt(H) rounded to bf16
            self.embed_scale = float(torch.tensor(spec.hidden_size**0.5, dtype=torch.bfloat16))
        else:
            self.embed_scale = 1.0
        self._rope: dict = {}
        self._masks: dict = {}
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def rope(self, kind: str, T: int, device):
        base = self.spec.local_rope_theta if kind == "sliding_attention" else self.spec.rope_theta
        key = (base, T, str(device))
        if key not in self._rope:
            self._rope[key] = rope_tables(self.spec.head_dim, base, T, device)
        return self._rope[key]

    def window_mask(self, T: int, device):
        key = (T, str(device))
        if key not in self._masks:
            i = torch.arange(T, device=device)
            d = i[:, None] - i[None, :]
            self._masks[key] = (d >= 0) & (d < self.spec.sliding_window)
        return self._masks[key]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        return h * self.embed_scale if self.embed_scale != 1.0 else h

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        h = self.embed(ids)
        for kind, layer in zip(self.spec.layer_types, self.model.layers):
            cos, sin = self.rope(kind, T, ids.device)
            mask = None
            if kind == "sliding_attention" and T > self.spec.sliding_window:
                mask = self.window_mask(T, ids.device)
            h = layer(h, cos, sin, mask)
        return self.model.norm(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.model.embed_tokens.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(ids))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def distill_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                 ce_weight: float) -> torch.Tensor:
    """``ce_weight`` * cross-entropy on the data + (1 - ``ce_weight``) * KL(teacher || student)
    at temperature 1. The KL term pulls the student towards the teacher's whole next-token
    distribution, which is what speculative acceptance measures (DistillSpec, Zhou et al.
    2023); the CE term keeps it anchored to the data."""
    V = logits.shape[-1]
    log_q = F.log_softmax(logits.float().reshape(-1, V), dim=-1)
    log_p = F.log_softmax(teacher_logits.float().reshape(-1, V), dim=-1)
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
    if ce_weight <= 0:
        return kl
    ce = F.nll_loss(log_q, targets.reshape(-1))
    return ce_weight * ce + (1 - ce_weight) * kl


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def hf_config(spec: ModelSpec, eos_id: int) -> dict:
    """config.json readable by transformers 5 and mlx-lm (legacy rope keys included)."""
    common = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "layer_types": list(spec.layer_types),
    }
    if spec.arch == "qwen3":
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **common,
            "hidden_act": "silu",
            "rope_theta": spec.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
            "rope_scaling": None,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": spec.num_layers,
        }
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **common,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": spec.head_dim,
        "sliding_window": spec.sliding_window,
        "sliding_window_pattern": spec.sliding_window_pattern,
        "rope_theta": spec.rope_theta,
        "rope_local_base_freq": spec.local_rope_theta,
        "rope_scaling": None,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": spec.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": spec.local_rope_theta},
        },
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


def param_estimate(spec: ModelSpec) -> int:
    return count_params(CausalLM(spec))


def cosine_lr(frac: float, min_ratio: float) -> float:
    frac = min(max(frac, 0.0), 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
