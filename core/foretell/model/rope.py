"""Rotary position embeddings, built from the ``rope_*`` fields of ``config.json``.

Every variant ends in one ``mx.fast.rope`` call; variants differ in the frequencies they
hand it, a scale on the rotated features (yarn, longrope) or a base that grows with the
sequence (dynamic). Interpretation follows mlx-lm's ``initialize_rope`` (the numerical
oracle) in every detail, so both read a checkpoint the same way: longrope always uses the
long factors and the non-traditional layout, and mrope is plain RoPE for text (its three
sections see the same positions).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

SUPPORTED = ("default", "linear", "proportional", "llama3", "yarn", "dynamic", "longrope", "mrope")


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
        input_scale: float = 1.0,
    ):
        self.dims = dims
        self.traditional = traditional
        self.base = None if freqs is not None else base
        self.scale = scale
        self.freqs = freqs
        #: Multiplies the rotated features first (yarn's and longrope's attention scaling).
        self.input_scale = input_scale

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        if self.input_scale != 1.0:
            x = x.at[..., : self.dims].multiply(self.input_scale)
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offset,
            freqs=self.freqs,
        )


class DynamicNTKRoPE(RoPE):
    """Dynamic NTK scaling: past ``max_position_embeddings`` the base grows with the
    sequence seen so far (offset + this call's length), as in mlx-lm and transformers.
    Keys already cached keep the rotation of the call that wrote them, so the result
    depends on how a long sequence was split into calls, exactly as mlx-lm's does."""

    def __init__(
        self, dims: int, *, base: float, traditional: bool, factor: float, max_positions: int
    ):
        super().__init__(dims, base=base, traditional=traditional)
        self.factor = factor
        self.max_positions = max_positions

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        seen = max(x.shape[-2] + offset, self.max_positions)
        growth = (self.factor * seen / self.max_positions) - (self.factor - 1)
        base = self.base * growth ** (self.dims / (self.dims - 2))
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=base, scale=1.0, offset=offset
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
    if kind == "yarn":
        freqs, mscale = _yarn(dims, base, scaling, field)
        return RoPE(dims, base=base, traditional=traditional, freqs=freqs, input_scale=mscale)
    if kind == "dynamic":
        return DynamicNTKRoPE(
            dims,
            base=base,
            traditional=traditional,
            factor=_num(scaling, "factor", field),
            max_positions=_max_positions(max_position_embeddings, kind, field),
        )
    if kind == "longrope":
        freqs, mscale = _longrope(dims, base, scaling, max_position_embeddings, field)
        return RoPE(dims, base=base, traditional=False, freqs=freqs, input_scale=mscale)
    if kind == "mrope":
        section = scaling.get("mrope_section")
        if not isinstance(section, list) or len(section) != 3:
            raise ValueError(f"{field}.mrope_section: expected a list of 3 sizes, got {section!r}")
        return RoPE(dims, base=base, traditional=traditional)
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


def _max_positions(value: int | None, kind: str, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(
            f"{field}: '{kind}' scaling needs a positive max_position_embeddings, got {value!r}"
        )
    return value


def _yarn(
    dims: int, base: float, scaling: dict[str, Any], field: str
) -> tuple[mx.array, float]:
    """YaRN: interpolate low frequencies by ``factor``, keep high ones, ramp between, and
    scale the rotated features by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``."""
    factor = _num(scaling, "factor", field)
    original = _opt(scaling, "original_max_position_embeddings", 4096, field)
    beta_fast = _opt(scaling, "beta_fast", 32, field)
    beta_slow = _opt(scaling, "beta_slow", 1, field)

    def correction_dim(rotations: float) -> float:
        return (dims * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dims - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolate = 1.0 - ramp
    original_freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    scaled_freqs = factor * original_freqs
    freqs = (scaled_freqs * original_freqs) / (
        scaled_freqs * extrapolate + original_freqs * (1 - extrapolate)
    )
    ratio = mscale(_opt(scaling, "mscale", 1, field)) / mscale(
        _opt(scaling, "mscale_all_dim", 0, field)
    )
    return freqs, ratio


def _longrope(
    dims: int, base: float, scaling: dict[str, Any], max_positions: int | None, field: str
) -> tuple[mx.array, float]:
    """LongRoPE (Su-scaled): per-frequency long factors, and a feature scale that grows
    with how far ``max_position_embeddings`` extends the original context."""
    original = _num(scaling, "original_max_position_embeddings", field)
    max_positions = _max_positions(max_positions, "longrope", field)
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if isinstance(factors, list):
            if len(factors) != dims // 2 or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) for f in factors
            ):
                raise ValueError(f"{field}.{key}: expected {dims // 2} numbers")
        else:
            _num(scaling, key, field)
    freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    freqs = mx.array(scaling["long_factor"], dtype=mx.float32) * freqs
    extension = max_positions / original
    scale = 1.0 if extension <= 1.0 else math.sqrt(1 + math.log(extension) / math.log(original))
    return freqs, scale


def _opt(scaling: dict[str, Any], key: str, default: float, field: str) -> float:
    return _num(scaling, key, field) if key in scaling else default
