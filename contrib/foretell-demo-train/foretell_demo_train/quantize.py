"""MLX affine quantization in pure numpy, bit-for-bit equal to ``mx.quantize`` (group
size 64, 4 or 8 bits) on bfloat16 weights, so the GPU host (no MLX) can write the
checkpoints ``mlx_lm.convert -q`` would write.

bfloat16 arrays are carried as uint16 bit patterns (numpy has no bfloat16).
"""

from __future__ import annotations

import numpy as np

GROUP_SIZE = 64
SUPPORTED_BITS = (4, 8)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (round to nearest even), as uint16 bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = np.isnan(x)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    out[nan] = 0x7FC0
    return out


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def quantize(w_bf16: np.ndarray, bits: int, group_size: int = GROUP_SIZE):
    """Quantize a 2-D bfloat16 matrix (uint16 bits) along its last axis.

    Returns (packed uint32 [rows, cols*bits/32], scales bf16 bits, biases bf16 bits),
    the layout of ``mx.quantize(w, group_size, bits)``.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}")
    rows, cols = w_bf16.shape
    if cols % group_size:
        raise ValueError(f"last dim {cols} is not a multiple of group size {group_size}")
    w = bf16_bits_to_f32(w_bf16).reshape(rows, cols // group_size, group_size)
    n_bins = np.float32((1 << bits) - 1)
    eps = np.float32(1e-7)
    w_max = w.max(axis=-1, keepdims=True)
    w_min = w.min(axis=-1, keepdims=True)
    mask = np.abs(w_min) > np.abs(w_max)
    scales = np.maximum((w_max - w_min) / n_bins, eps).astype(np.float32)
    scales = np.where(mask, scales, -scales)
    edge = np.where(mask, w_min, w_max)
    q0 = np.round(edge / scales)
    scales = np.where(q0 != 0, edge / np.where(q0 != 0, q0, 1), scales).astype(np.float32)
    biases = np.where(q0 == 0, np.float32(0), edge).astype(np.float32)
    # MLX quantizes with the float32 scale/bias, then stores them in the weight dtype
    q = np.clip(np.round((w - biases) / scales), 0, n_bins).astype(np.uint32).reshape(rows, cols)
    s_bits = f32_to_bf16_bits(scales)
    b_bits = f32_to_bf16_bits(biases)
    per = 32 // bits
    q = q.reshape(rows, cols // per, per)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    packed = np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)
    return packed, s_bits.reshape(rows, -1), b_bits.reshape(rows, -1)


def dequantize(packed: np.ndarray, s_bits: np.ndarray, b_bits: np.ndarray, bits: int,
               group_size: int = GROUP_SIZE) -> np.ndarray:
    """float32 weights: scale * q + bias per group."""
    rows = packed.shape[0]
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    q = ((packed[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(rows, -1, group_size)
    s = bf16_bits_to_f32(s_bits)[:, :, None]
    b = bf16_bits_to_f32(b_bits)[:, :, None]
    return (q.astype(np.float32) * s + b).reshape(rows, -1)


def quantizable(name: str, shape: tuple[int, ...], group_size: int = GROUP_SIZE) -> bool:
    """What mlx-lm quantizes: Linear and Embedding weights whose last dim fits the groups
    (norm weights are 1-D and stay in bf16)."""
    return name.endswith(".weight") and len(shape) == 2 and shape[-1] % group_size == 0


def quantize_state(state: dict[str, np.ndarray], bits: int) -> dict[str, np.ndarray]:
    """float32 state dict -> MLX checkpoint tensors (uint32/bf16-bits arrays)."""
    out: dict[str, np.ndarray] = {}
    for name, w in state.items():
        wb = f32_to_bf16_bits(w)
        if quantizable(name, w.shape):
            base = name[: -len(".weight")]
            out[name], out[base + ".scales"], out[base + ".biases"] = quantize(wb, bits)
        else:
            out[name] = wb
    return out


def roundtrip_state(state: dict[str, np.ndarray], bits: int | None) -> dict[str, np.ndarray]:
    """float32 weights as the quantized (or, for bits=None, bf16) checkpoint represents
    them; for measuring the quality cost of each choice."""
    out = {}
    for name, w in state.items():
        wb = f32_to_bf16_bits(w)
        if bits and quantizable(name, w.shape):
            out[name] = dequantize(*quantize(wb, bits), bits)
        else:
            out[name] = bf16_bits_to_f32(wb).reshape(w.shape)
    return out


def nbytes(tensors: dict[str, np.ndarray]) -> int:
    return sum(t.nbytes for t in tensors.values())
