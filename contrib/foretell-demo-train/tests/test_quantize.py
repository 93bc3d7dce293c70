"""The numpy MLX quantizer: bit-for-bit against mx.quantize where MLX is importable, and
round-trip/packing properties everywhere."""

import numpy as np
import pytest

from foretell_demo_train import quantize as Q


def _matrices():
    rng = np.random.default_rng(0)
    for scale in (0.02, 1.0, 5e-4):
        w = (rng.standard_normal((48, 256)) * scale).astype(np.float32)
        w[:2, :64] = 0.0  # all-zero group
        w[2:4] = np.abs(w[2:4])  # one-signed groups
        w[4:6] = -np.abs(w[4:6])
        w[6, :64] = 0.7  # constant group
        yield w


@pytest.mark.parametrize("bits", [4, 8])
def test_matches_mx_quantize_bit_for_bit(bits):
    mx = pytest.importorskip("mlx.core")
    for w in _matrices():
        wb = Q.f32_to_bf16_bits(w)
        mw = mx.array(w).astype(mx.bfloat16)
        assert (np.array(mw.view(mx.uint16)) == wb).all()
        packed, scales, biases = mx.quantize(mw, group_size=64, bits=bits)
        p2, s2, b2 = Q.quantize(wb, bits)
        assert (np.array(packed) == p2).all()
        assert (np.array(scales.view(mx.uint16)) == s2).all()
        assert (np.array(biases.view(mx.uint16)) == b2).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_roundtrip_error_is_within_one_step(bits):
    for w in _matrices():
        wb = Q.f32_to_bf16_bits(w)
        packed, s, b = Q.quantize(wb, bits)
        assert packed.dtype == np.uint32 and packed.shape == (48, 256 * bits // 32)
        assert s.shape == b.shape == (48, 256 // 64)
        deq = Q.dequantize(packed, s, b, bits).reshape(48, 4, 64)
        step = np.abs(Q.bf16_bits_to_f32(s))[:, :, None]
        bias = np.abs(Q.bf16_bits_to_f32(b))[:, :, None]
        err = np.abs(deq - Q.bf16_bits_to_f32(wb).reshape(48, 4, 64))
        # MLX pins the larger-magnitude edge exactly, so the far edge can clip by up to one
        # step; plus the bf16 rounding of the stored scale (times q) and bias
        bound = step + 2.0**-8 * (bias + ((1 << bits) - 1) * step) + 1e-6
        assert (err <= bound).all()


def test_bf16_rounding_is_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e38], dtype=np.float32)
    back = Q.bf16_bits_to_f32(Q.f32_to_bf16_bits(x))
    assert back[0] == 1.0 and back[1] == 1.0 and back[2] == 1.015625 and back[3] == -2.5


def test_quantize_state_layout():
    state = {"model.embed_tokens.weight": np.ones((8, 128), np.float32),
             "model.norm.weight": np.ones(128, np.float32),
             "odd.weight": np.ones((4, 96), np.float32)}
    out = Q.quantize_state(state, 4)
    assert out["model.embed_tokens.weight"].dtype == np.uint32
    assert "model.embed_tokens.scales" in out and "model.embed_tokens.biases" in out
    assert out["model.norm.weight"].dtype == np.uint16  # bf16, not quantized
    assert out["odd.weight"].dtype == np.uint16  # 96 is not a multiple of 64
