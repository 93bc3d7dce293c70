"""Affine-quantized KV (4 or 8 bits, groups along ``head_dim``): the cache, its codec, and
attention over quantized keys and values.

Groups run along ``head_dim``, never the token axis, so slicing tokens (trim, clones,
persisting only up to ``offset``) is byte-exact, and the cache stays trimmable at any length.

Numerics follow mlx-lm's ``generate_step(kv_bits=..., quantized_kv_start=0)``, the oracle:
the first update of an empty cache (the first prefill chunk) attends over the exact keys
and values it is given and stores them quantized; every later update attends over the
quantized history. ``mlx-lm`` converts its cache after that first chunk; this does the
same without a conversion step. Sliding-window (rotating) layers stay unquantized, as in
mlx-lm, whose rotating cache cannot be quantized.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx

from foretell.config import engine_choice
from foretell.errors import CodecError, GenerationError
from foretell.model.attention import Mask, softmax_rows
from foretell.model.kvcache import KVCache
from foretell.platform.device import device_mode

Triple = tuple[mx.array, mx.array, mx.array]  # packed uint32, scales, biases
_PARTS = ("packed", "scales", "biases")


def _grow(buffer: Triple | None, used: int, like: Triple, capacity: int) -> Triple:
    def one(old: mx.array | None, new: mx.array) -> mx.array:
        B, heads, _, width = new.shape
        fresh = mx.zeros((B, heads, capacity - used, width), new.dtype)
        if old is None or used == 0:
            return fresh
        return mx.concatenate([old[..., :used, :], fresh], axis=2)

    return tuple(one(None if buffer is None else buffer[i], like[i]) for i in range(3))


class QuantizedKVCache(KVCache):
    """A growable KV cache holding keys and values as affine-quantized triples. Masks,
    trimming and sizes are :class:`KVCache`'s (a prefix of ``offset`` tokens); storage,
    state and meta are its own. Codecs match caches by exact type, so it never passes for
    a plain :class:`KVCache`."""

    def __init__(self, bits: int = 8, group_size: int = 64) -> None:
        if bits not in (4, 8):
            raise ValueError(f"kv bits must be 4 or 8, got {bits}")
        super().__init__()
        self.bits = bits
        self.group_size = group_size
        self.keys: Triple | None = None
        self.values: Triple | None = None

    def _quantize(self, x: mx.array) -> Triple:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        first = self.offset == 0
        if first and (keys.shape[-1] % self.group_size or values.shape[-1] % self.group_size):
            raise GenerationError(
                f"--kv-bits {self.bits}: this model's head_dim ({keys.shape[-1]}) is not a "
                f"multiple of the KV quantization group size {self.group_size}; run it "
                "without --kv-bits")
        qk, qv = self._quantize(keys), self._quantize(values)
        start, end = self.offset, self.offset + keys.shape[2]
        if self.keys is None or end > self.keys[0].shape[2]:
            capacity = -(-end // self.step) * self.step
            self.keys = _grow(self.keys, start, qk, capacity)
            self.values = _grow(self.values, start, qv, capacity)
        for stored, new in ((self.keys, qk), (self.values, qv)):
            for part, piece in zip(stored, new):
                part[..., start:end, :] = piece
        self.offset = end
        if first:
            return keys, values
        return self._view(self.keys, end), self._view(self.values, end)

    @staticmethod
    def _view(triple: Triple, stop: int) -> Triple:
        if stop == triple[0].shape[2]:
            return triple
        return tuple(x[..., :stop, :] for x in triple)

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))

    @property
    def state(self) -> tuple[mx.array, ...]:
        """The six arrays (key triple, value triple) holding exactly ``offset`` tokens."""
        if self.keys is None or self.offset == 0:
            return ()
        # Always fresh slices: a clone built from them must never share an array object
        # with the donor, or its in-place writes would change the donor.
        return tuple(x[..., : self.offset, :] for x in (*self.keys, *self.values))

    @property
    def meta(self) -> dict[str, Any]:
        return {"offset": self.offset, "bits": self.bits, "group_size": self.group_size}

    @classmethod
    def from_state(cls, state: Sequence[mx.array], meta: Mapping[str, Any]) -> QuantizedKVCache:
        cache = cls(int(meta["bits"]), int(meta["group_size"]))
        if state:
            if len(state) != 6:
                raise ValueError(f"a quantized KV state has 6 arrays, got {len(state)}")
            cache.keys, cache.values = tuple(state[:3]), tuple(state[3:])
            cache.offset = state[0].shape[2]
        if cache.offset != int(meta["offset"]):
            raise ValueError(f"quantized KV meta offset {meta['offset']} does not match the "
                             f"{cache.offset} tokens in its state")
        return cache


def quantize_caches(caches: list[Any], bits: int, group_size: int = 64) -> list[Any]:
    """``caches`` with every full-attention :class:`KVCache` replaced by an empty quantized
    one (sliding-window layers stay as they are)."""
    return [QuantizedKVCache(bits, group_size) if type(c) is KVCache and c.empty() else c
            for c in caches]


def kv_scheme(bits: int | None, group_size: int = 64) -> str:
    """The name entries of this KV scheme are stored under (their directory, namespace)."""
    return "plain" if bits is None else f"kv{bits}g{group_size}"


#: How attention over quantized KV takes its two products, read once (see
#: :func:`products_dequantized`).
_PRODUCTS_MODE: str | None = None


def products_dequantized() -> bool:
    """Whether attention over quantized KV dequantizes the keys and values for its two
    products instead of calling ``mx.quantized_matmul``: on CUDA, whose MLX build (0.32.4)
    has no kernel for attention's batched products ("No implementation for problem shape",
    for mlx-lm's quantized KV too). The cache and what it stores stay quantized; the output
    differs only by rounding in the products' accumulation. An engine's
    ``quantized_products`` setting (``quantized``/``dequantized``) forces either for its
    work; ``FORETELL_QUANTIZED_PRODUCTS`` is the process's default."""
    global _PRODUCTS_MODE
    chosen = engine_choice("quantized_products")
    if chosen is not None:
        return chosen == "dequantized"
    if _PRODUCTS_MODE is None:
        _PRODUCTS_MODE = device_mode("FORETELL_QUANTIZED_PRODUCTS", cuda="dequantized",
                                     elsewhere="quantized", choices=("quantized", "dequantized"))
    return _PRODUCTS_MODE == "dequantized"


def quantized_attend(queries: mx.array, keys: Triple, values: Triple, *, scale: float,
                     mask: Mask) -> mx.array:
    """Attention of ``[B, heads, L, D]`` queries over quantized key/value triples (grouped
    KV heads allowed), in mlx-lm's order of operations so greedy output matches it."""
    B, n_queries, L, D = queries.shape
    n_kv = keys[0].shape[1]
    bits = keys[0].shape[-1] * 32 // D
    group_size = D // keys[1].shape[-1]
    repeats = n_queries // n_kv
    queries = queries * scale
    if repeats > 1:
        queries = queries.reshape(B, n_kv, repeats, L, D)
        keys = tuple(mx.expand_dims(x, -3) for x in keys)
        values = tuple(mx.expand_dims(x, -3) for x in values)
    dequantized = products_dequantized()
    if dequantized:
        keys, values = (mx.dequantize(*x, group_size=group_size, bits=bits)
                        for x in (keys, values))
        scores = queries @ mx.swapaxes(keys, -1, -2)
    else:
        scores = mx.quantized_matmul(queries, *keys, transpose=True, group_size=group_size,
                                     bits=bits)
    if mask is not None:
        if isinstance(mask, str):
            n_q, n_k = scores.shape[-2:]
            mask = mx.arange(n_k - n_q, n_k)[:, None] >= mx.arange(n_k)[None]
        if repeats > 1 and mask.ndim == 4:  # a batch's per-row mask [B, 1, L, S]
            mask = mx.expand_dims(mask, 2)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    scores = softmax_rows(scores, precise=True)  # as mlx-lm: bfloat16 scores in float32
    if dequantized:
        out = scores @ values
    else:
        out = mx.quantized_matmul(scores, *values, transpose=False, group_size=group_size,
                                  bits=bits)
    return out.reshape(B, n_queries, L, -1) if repeats > 1 else out


class QuantizedKVCodec:
    """:class:`QuantizedKVCache`: the six arrays up to ``offset``; always trimmable."""

    name = "quantized-kv"
    provider_id = "foretell.baseline/quantized-kv@1"

    def matches(self, cache: Any) -> bool:
        return type(cache) is QuantizedKVCache

    def snapshot(self, cache: QuantizedKVCache) -> tuple[dict[str, mx.array], dict[str, Any]]:
        names = [f"{kind}.{part}" for kind in ("keys", "values") for part in _PARTS]
        tensors = dict(zip(names, cache.state))
        return tensors, cache.meta

    def load(self, tensors: Mapping[str, mx.array], meta: Mapping[str, Any]) -> QuantizedKVCache:
        names = [f"{kind}.{part}" for kind in ("keys", "values") for part in _PARTS]
        if tensors and set(tensors) != set(names):
            raise CodecError(f"codec '{self.name}' expects tensors {names}, got {sorted(tensors)}")
        return QuantizedKVCache.from_state([tensors[n] for n in names] if tensors else (), meta)

    def clone(self, cache: QuantizedKVCache) -> QuantizedKVCache:
        return self.load(*self.snapshot(cache))

    def header_trimmable(self, meta: Mapping[str, Any]) -> bool:
        return True

    def minimum_reusable_offset(self, meta: Mapping[str, Any]) -> int:
        return 0
