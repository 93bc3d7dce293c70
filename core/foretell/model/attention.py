"""Attention pieces every architecture shares: causal / sliding-window masks and the
fused scaled-dot-product call.

A mask is ``None`` (one query: it may see every key it is given), the string
``"causal"`` (``mx.fast.scaled_dot_product_attention`` aligns it to the newest key, so it
is right whatever the cache holds before the queries), or a boolean array
``[queries, keys]`` where ``True`` means "may attend".
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from foretell.config import engine_choice
from foretell.platform.device import on_cpu

Mask = mx.array | str | None


#: The last mask built and its arguments: every layer of one forward asks for the same one,
#: so they share one array (one graph node, not one per layer: on CUDA a verify round is
#: bound by the host's per-node work, docs/speculation.md).
_LAST_CAUSAL: tuple[Any, mx.array | None] = (None, None)


def causal_mask(n_queries: int, n_prior: int = 0, window: int | None = None) -> mx.array:
    """Boolean mask for ``n_queries`` new tokens that follow ``n_prior`` keys.

    Query ``i`` sits at key position ``n_prior + i``; it may read key ``j`` when
    ``j <= n_prior + i`` and, with a ``window``, when fewer than ``window`` positions
    separate them (the token itself counts, so it sees ``window`` keys at most).
    """
    global _LAST_CAUSAL
    key, mask = _LAST_CAUSAL
    if key == (n_queries, n_prior, window):
        return mask
    key_pos = mx.arange(n_prior + n_queries)[None]
    query_pos = mx.arange(n_prior, n_prior + n_queries)[:, None]
    mask = query_pos >= key_pos
    if window is not None:
        mask = mask & (query_pos - key_pos < window)
    _LAST_CAUSAL = ((n_queries, n_prior, window), mask)
    return mask


def attention_mask(n_queries: int, cache: Any = None, window: int | None = None) -> Mask:
    """The mask for ``n_queries`` new tokens attending through ``cache``.

    A cache knows which keys it will hand back, so it builds the mask (see
    :meth:`foretell.model.kvcache.KVCache.mask`); without one, every key is a new token.
    """
    if cache is not None:
        return cache.mask(n_queries)
    if n_queries == 1:
        return None
    if window is not None and n_queries > window:
        return causal_mask(n_queries, 0, window)
    return "causal"


def attend(
    queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask: Mask
) -> mx.array:
    """Attention over ``[B, heads, L, dim]`` arrays (grouped KV heads allowed): the fused
    kernel, except for multi-token queries on CUDA and every query on the CPU (see
    :func:`use_matmul_attention`)."""
    if isinstance(keys, tuple):  # affine-quantized KV: (packed, scales, biases)
        from foretell.cache.quantized import quantized_attend

        return quantized_attend(queries, keys, values, scale=scale, mask=mask)
    if use_matmul_attention(queries.shape[2], keys.shape[2], queries.shape[1], queries.dtype):
        return matmul_attention(queries, keys, values, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


#: On CUDA a multi-token query shorter than a full prefill chunk attends through
#: :func:`matmul_attention` while its score matrix (query heads x queries x keys) has at most
#: ``MATMUL_MAX_SCORES`` elements: the fused kernel is planned afresh for every new shape,
#: which costs more than matmuls wherever shapes rarely repeat (verify windows, catch-ups,
#: suffixes after a cache hit); full chunks repeat theirs and keep it (figures:
#: docs/decisions.md). The rule reads the shape alone, so a request's arithmetic does not
#: depend on what ran before it.
FULL_CHUNK = 2048
MATMUL_MAX_SCORES = 128 * 2**20
_MATMUL_MODE: str | None = None


def use_matmul_attention(n_queries: int, n_keys: int, heads: int,
                         dtype: mx.Dtype | None = None) -> bool:
    """Whether ``n_queries`` new tokens of ``heads`` query heads (of ``dtype``) attend to
    ``n_keys`` keys through plain matmuls instead of the fused kernel (see ``FULL_CHUNK``).

    The CPU takes matmuls for every float32 query: MLX has no CPU kernel, and its fallback
    is the same matmuls around a slower softmax (docs/blas.md, "Softmax"); a bfloat16 model
    there keeps the fallback, whose rounding is mlx-lm's. Metal keeps the fused kernel.
    An engine's ``attention`` setting (:class:`~foretell.config.EngineSettings`) forces a
    rule for its work: ``fused``, ``matmul``, ``matmul-float32`` or ``matmul-all``;
    ``FORETELL_ATTENTION`` is the process's default.
    """
    global _MATMUL_MODE
    mode = engine_choice("attention")
    if mode is None:
        if _MATMUL_MODE is None:
            from foretell.platform.device import device_mode

            _MATMUL_MODE = device_mode(
                "FORETELL_ATTENTION", cuda="matmul", cpu="matmul-float32", elsewhere="fused",
                choices=("fused", "matmul", "matmul-float32", "matmul-all"))
        mode = _MATMUL_MODE
    if mode == "fused":
        return False
    if mode == "matmul-all":
        return True
    if mode == "matmul-float32":
        return dtype == mx.float32
    return 1 < n_queries < FULL_CHUNK and heads * n_queries * n_keys <= MATMUL_MAX_SCORES


def matmul_attention(
    queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask: Mask
) -> mx.array:
    """Softmax attention written as matmuls, with the fused kernel's mask semantics
    (``"causal"`` aligned to the newest key).

    Everything between the inputs and the output runs in float32, as the fused kernel's
    single-token path does: the scaled query, the scores, the softmax and the weighted sum
    of values: scores rounded to bfloat16 moved a verify window's logits far enough from
    single-token decode's to change greedy tokens (docs/speculation.md)."""
    B, heads, L, dim = queries.shape
    kv_heads, S = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    f32 = mx.float32
    # A KV head's query heads stacked as rows (group-major), so every product is one plain
    # batched matmul with no broadcast of the keys: fewer graph nodes per layer.
    q = (queries.astype(f32) * scale).reshape(B, kv_heads, group * L, dim)
    keys_t = keys.astype(f32).swapaxes(-1, -2)
    if isinstance(mask, str):
        mask = causal_mask(L, S - L)
    if mask is None:
        scores = q @ keys_t  # [B, kv, group * L, S]
    else:  # the mask as 0 / -inf, added by the matmul itself: exactly where() on the scores
        scores = mx.addmm(_additive(mask, group), q, keys_t)
    weights = softmax_rows(scores)
    out = weights @ values.astype(f32)  # [B, kv, group * L, dim]
    return out.reshape(B, heads, L, dim).astype(queries.dtype)


#: Score matrices of at least this many elements take numpy's softmax on the CPU; below it
#: the evaluation it needs costs more than MLX's slower exp saves (a decode step's scores).
NUMPY_SOFTMAX_MIN = 1 << 18


def softmax_rows(scores: mx.array, *, precise: bool = False) -> mx.array:
    """``mx.softmax(scores, axis=-1, precise=precise)``; for float32 ``scores`` of at least
    :data:`NUMPY_SOFTMAX_MIN` elements on the CPU, computed by numpy in their own buffer.

    MLX's CPU build for x86 computes ``exp`` one element at a time, an order of magnitude
    slower than numpy's vectorized one (figures: docs/blas.md, "Softmax"). The scores are
    evaluated here and overwritten in place: callers pass a fresh product's output, which
    nothing else reads."""
    if scores.size < NUMPY_SOFTMAX_MIN or scores.dtype != mx.float32 or not on_cpu():
        return mx.softmax(scores, axis=-1, precise=precise)
    import numpy as np

    mx.eval(scores)
    buffer = memoryview(scores)
    if buffer.readonly or not buffer.c_contiguous:
        return mx.softmax(scores, axis=-1, precise=precise)
    rows = np.frombuffer(buffer, dtype=np.float32).reshape(scores.shape)
    rows -= rows.max(axis=-1, keepdims=True)
    np.exp(rows, out=rows)
    rows /= rows.sum(axis=-1, keepdims=True)
    return scores


_LAST_ADDITIVE: tuple[mx.array | None, mx.array | None] = (None, None)


def _additive(mask: mx.array, group: int) -> mx.array:
    """``mask`` ``[L, S]`` as float32 scores to add, 0 where it lets a query attend and -inf
    where not (a float mask as it is), repeated for ``group`` query heads stacked as rows:
    ``[group * L, S]``. Layers sharing one mask share its additive form."""
    global _LAST_ADDITIVE
    seen, additive = _LAST_ADDITIVE
    if seen is mask and additive.shape[-2] == group * mask.shape[-2]:
        return additive
    if mask.dtype == mx.bool_:
        additive = mx.where(mask, mx.array(0.0, mx.float32), mx.array(-mx.inf, mx.float32))
    else:
        additive = mask.astype(mx.float32)
    if group > 1:
        additive = mx.tile(additive, (group, 1))
    _LAST_ADDITIVE = (mask, additive)
    return additive
