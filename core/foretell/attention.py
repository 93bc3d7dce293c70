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

Mask = mx.array | str | None


def causal_mask(n_queries: int, n_prior: int = 0, window: int | None = None) -> mx.array:
    """Boolean mask for ``n_queries`` new tokens that follow ``n_prior`` keys.

    Query ``i`` sits at key position ``n_prior + i``; it may read key ``j`` when
    ``j <= n_prior + i`` and, with a ``window``, when fewer than ``window`` positions
    separate them (the token itself counts, so it sees ``window`` keys at most).
    """
    key_pos = mx.arange(n_prior + n_queries)[None]
    query_pos = mx.arange(n_prior, n_prior + n_queries)[:, None]
    mask = query_pos >= key_pos
    if window is not None:
        mask = mask & (query_pos - key_pos < window)
    return mask


def attention_mask(n_queries: int, cache: Any = None, window: int | None = None) -> Mask:
    """The mask for ``n_queries`` new tokens attending through ``cache``.

    A cache knows which keys it will hand back, so it builds the mask (see
    :meth:`foretell.kvcache.KVCache.mask`); without one, every key is a new token.
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
    """Fused attention over ``[B, heads, L, dim]`` arrays (grouped KV heads allowed)."""
    if isinstance(keys, tuple):  # affine-quantized KV: (packed, scales, biases)
        from foretell.cache.quantized import quantized_attend

        return quantized_attend(queries, keys, values, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
