"""The matmul attention path (matmuls + mask + softmax: the verifier's on CUDA, every
float32 query's on the CPU) computes what the fused kernel does, for every mask kind the
caches hand out, with grouped KV heads; on the CPU large scores take numpy's softmax."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from foretell.model import attention
from foretell.model.attention import causal_mask, matmul_attention


@pytest.mark.parametrize("L, prior, window", [(1, 20, None), (3, 40, None), (5, 0, None),
                                              (4, 9, 8), (7, 3, 8)])
@pytest.mark.parametrize("mask_kind", ["causal", "array"])
def test_matmul_attention_matches_the_fused_kernel(L, prior, window, mask_kind):
    keys_ = mx.random.split(mx.random.key(L * 100 + prior), 3)
    q = mx.random.normal((1, 8, L, 16), key=keys_[0])
    k = mx.random.normal((1, 2, prior + L, 16), key=keys_[1])
    v = mx.random.normal((1, 2, prior + L, 16), key=keys_[2])
    if L == 1:
        mask = None
    elif mask_kind == "causal" and window is None:
        mask = "causal"
    else:
        mask = causal_mask(L, prior, window)
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    ours = matmul_attention(q, k, v, scale=0.25, mask=mask)
    np.testing.assert_allclose(np.array(ours), np.array(fused), rtol=1e-5, atol=1e-5)


def test_multi_token_queries_under_a_full_chunk_take_the_matmul_path_when_on(monkeypatch):
    from foretell.request import PREFILL_CHUNK

    assert attention.FULL_CHUNK == PREFILL_CHUNK  # full chunks repeat their shapes
    monkeypatch.setattr(attention, "_MATMUL_MODE", "matmul")
    limit = attention.MATMUL_MAX_SCORES
    cases = [(1, 4096, 32), (2, 1000, 8), (33, 1000, 8), (2047, 3040, 8),  # demo shapes
             (2048, 2048, 8), (2048, 4096, 32), (2047, 4095, 32),  # 4B prefill chunks
             (1024, limit // (1024 * 32), 32), (1024, limit // (1024 * 32) + 1, 32)]
    assert [attention.use_matmul_attention(*case) for case in cases] == [
        False, True, True, True, False, False, False, True, False]
    monkeypatch.setattr(attention, "_MATMUL_MODE", "fused")
    assert not any(attention.use_matmul_attention(n, 100, 8) for n in (1, 2, 32))
    monkeypatch.setattr(attention, "_MATMUL_MODE", "matmul-all")
    assert attention.use_matmul_attention(1, 4096, 32)
    assert attention.use_matmul_attention(2048, 4096, 32)


def test_bfloat16_inputs_attend_in_float32_like_the_single_token_kernel():
    """A verify window's attention must not round its scores to bfloat16: with scores of a
    few units, that rounding alone moves the softmax weights by percents, and greedy tokens
    of a bf16 target then differ from single-token decode (which scores in float32)."""
    keys_ = mx.random.split(mx.random.key(7), 3)
    q = (mx.random.normal((1, 8, 4, 64), key=keys_[0])).astype(mx.bfloat16)
    k = (mx.random.normal((1, 2, 300, 64), key=keys_[1])).astype(mx.bfloat16)
    v = (mx.random.normal((1, 2, 300, 64), key=keys_[2])).astype(mx.bfloat16)
    mask = causal_mask(4, 296)
    reference = matmul_attention(q.astype(mx.float32), k.astype(mx.float32),
                                 v.astype(mx.float32), scale=0.5, mask=mask)
    ours = matmul_attention(q, k, v, scale=0.5, mask=mask)
    assert ours.dtype == mx.bfloat16
    error = np.abs(np.array(ours.astype(mx.float32)) - np.array(reference))
    scale = np.abs(np.array(reference)).max()
    # one bfloat16 rounding of the output (2**-8 relative), nothing more
    assert error.max() <= scale * 2.0**-8


def test_the_layers_of_one_forward_share_one_mask():
    """Every layer of a verify forward asks for the same causal mask: they get one array
    (one graph node; on CUDA a round's cost grows with its nodes), and a new window a new
    one."""
    first = causal_mask(4, 10)
    assert causal_mask(4, 10) is first
    assert causal_mask(4, 11) is not first and causal_mask(4, 10, 8) is not first
    np.testing.assert_array_equal(np.array(causal_mask(4, 10)),
                                  np.arange(14)[None] <= np.arange(10, 14)[:, None])


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text"])
def test_prefill_chunks_under_the_cuda_rule_compute_what_the_fused_kernel_does(
    engines, monkeypatch, name
):
    """On CUDA a prompt's chunks, and a suffix after a cache hit, attend through matmuls
    (forced here on the CPU): the same logits and caches as the fused kernel's, also for
    sliding-window layers whose window the chunks overrun."""
    model = engines[name].model
    taken = []
    real = attention.matmul_attention

    def counted(*args, **kwargs):
        taken.append(args[0].shape[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "matmul_attention", counted)
    chunks = [list(range(3, 43)), [(5 * i) % 190 + 2 for i in range(25)]]
    out = {}
    for mode in ("fused", "matmul"):
        monkeypatch.setattr(attention, "_MATMUL_MODE", mode)
        caches = model.make_caches()
        logits = [model.logits(model.forward(mx.array([c]), caches)[0]) for c in chunks]
        mx.eval(logits, [c.state for c in caches])
        out[mode] = logits, caches
        assert bool(taken) == (mode == "matmul"), mode
    for a, b in zip(out["fused"][0], out["matmul"][0]):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)
    assert set(taken) == {40, 25}


def test_on_the_cpu_float32_queries_take_matmuls_and_others_the_fused_kernel(monkeypatch):
    """The CPU's rule (``matmul-float32``): its own float32 precision through matmuls and
    numpy's softmax, a bfloat16 model through the fallback whose rounding is mlx-lm's."""
    from foretell.platform import device

    monkeypatch.setattr(attention, "_MATMUL_MODE", None)
    monkeypatch.delenv("FORETELL_ATTENTION", raising=False)
    monkeypatch.setattr(device, "on_cpu", lambda: True)
    for n in (1, 4, 2048):
        assert attention.use_matmul_attention(n, 4096, 8, mx.float32)
        assert not attention.use_matmul_attention(n, 4096, 8, mx.bfloat16)
    assert attention._MATMUL_MODE == "matmul-float32"


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="numpy's softmax is the CPU's")
def test_large_scores_are_softmaxed_by_numpy_in_their_own_buffer(monkeypatch):
    """Past NUMPY_SOFTMAX_MIN elements the CPU's softmax is numpy's, written over the
    scores (MLX's would take ~10x as long), and equals MLX's to float32 rounding; smaller
    ones stay MLX's."""
    rows = attention.NUMPY_SOFTMAX_MIN // 512
    scores = mx.random.normal((1, 2, rows, 512), key=mx.random.key(3)) * 4
    scores = mx.where(mx.arange(512) < 500, scores, -mx.inf)  # a masked tail, as causal
    expected = mx.softmax(scores, axis=-1)
    mx.eval(scores, expected)
    calls = []
    real = mx.softmax
    monkeypatch.setattr(mx, "softmax", lambda *a, **k: calls.append(a[0].size) or real(*a, **k))
    got = attention.softmax_rows(scores)
    assert calls == [] and got is scores  # numpy's, in place
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-5, atol=1e-7)
    assert float(mx.abs(got[..., 500:]).max()) == 0.0
    small = mx.random.normal((1, 2, 4, 512), key=mx.random.key(4))
    attention.softmax_rows(small)
    assert calls == [small.size]
