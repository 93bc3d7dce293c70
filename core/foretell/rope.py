"""Rotary position embeddings, built from the ``rope_*`` fields of ``config.json``.

Every variant ends in one ``mx.fast.rope`` call; variants only differ in the
frequencies they hand it. Interpretation follows mlx-lm's (the numerical oracle), so
both read a checkpoint the same way.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

SUPPORTED = ("default", "linear", "proportional", "llama3")


class RoPE:
    """Rotates the first ``dims`` features of ``[B, heads, L, head_dim]`` arrays.

    Plain object (not an ``nn.Module``) on purpose: it holds no trainable state, so it
    must never show up among a model's parameters.
    """

    def __init__(
        self,
        dims: int,
        *,
        base: float,
        traditional: bool = False,
        scale: float = 1.0,
        freqs: mx.array | None = None,
    ):
        self.dims = dims
        self.traditional = traditional
        self.base = None if freqs is not None else base
        self.scale = scale
        self.freqs = freqs

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offset,
            freqs=self.freqs,
        )


def rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("type") or scaling.get("rope_type") or "default"


def make_rope(
    dims: int,
    *,
    base: float,
    traditional: bool = False,
    scaling: dict[str, Any] | None = None,
    max_position_embeddings: int | None = None,
    field: str = "rope_scaling",
) -> RoPE:
    """The RoPE a config asks for; ``field`` names the config entry in errors."""
    kind = rope_type(scaling)
    if kind == "default":
        return RoPE(dims, base=base, traditional=traditional)
    if kind == "linear":
        return RoPE(
            dims, base=base, traditional=traditional, scale=1.0 / _num(scaling, "factor", field)
        )
    if kind == "proportional":
        # Partial rotary (Gemma 4 global layers): the exponent keeps the full head width in
        # its denominator, and the unrotated tail gets infinite wavelength.
        rotated = int(dims * float(scaling.get("partial_rotary_factor", 1.0)))
        if rotated > dims:
            raise ValueError(f"{field}.partial_rotary_factor: must be at most 1")
        exponents = mx.arange(0, rotated, 2, dtype=mx.float32) / dims
        factor = float(scaling.get("factor", 1.0))
        tail = mx.full(((dims - rotated) // 2,), mx.inf)
        freqs = mx.concatenate([factor * (base**exponents), tail])
        return RoPE(dims, base=base, traditional=traditional, freqs=freqs)
    if kind == "llama3":
        return RoPE(
            dims,
            base=base,
            traditional=traditional,
            freqs=_llama3_freqs(dims, base, scaling, field),
        )
    raise ValueError(
        f"{field}.rope_type: '{kind}' is not supported (supported: {', '.join(SUPPORTED)})"
    )


def _num(scaling: dict[str, Any], key: str, field: str) -> float:
    value = scaling.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{field}.{key}: expected a number, got {value!r}")
    return float(value)


def _llama3_freqs(dims: int, base: float, scaling: dict[str, Any], field: str) -> mx.array:
    factor = _num(scaling, "factor", field)
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    freqs = base ** (mx.arange(0, dims, 2) / dims)
    wavelens = 2 * math.pi * freqs
    low_wavelen = original / low
    high_wavelen = original / high
    freqs = mx.where(wavelens > low_wavelen, freqs * factor, freqs)
    medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
    smooth = (original / wavelens - low) / (high - low)
    smoothed = freqs / ((1 - smooth) / factor + smooth)
    return mx.where(medium, smoothed, freqs)
