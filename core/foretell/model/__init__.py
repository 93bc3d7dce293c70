"""The model contract and the building blocks architectures are made of.

Architecture plugins import from here: the contract (:class:`Model`, :class:`Cache`, the
ports), the KV caches (:class:`KVCache`, :class:`RotatingKVCache`, :class:`SlidingKVCache`
and their trim helpers), attention (:func:`attend`, the masks), fixed-shape forwards
(:func:`fixed_for`, :func:`fixed_or_ordinary`), RoPE (:func:`make_rope`) and loading
(:func:`load_model`, :func:`read_config`, :func:`args_from_config` and the checkpoint-quirk
helpers); ``_WHERE`` below lists every name. Names resolve on first use, so importing this package imports no
MLX: on the CPU the BLAS must be bound before MLX loads (docs/blas.md).
"""

from __future__ import annotations

from foretell.surface import lazy_exports

_WHERE = {
    "Cache": "foretell.model.contract",
    "Model": "foretell.model.contract",
    "PORT_MTP": "foretell.model.contract",
    "PORT_TAPS": "foretell.model.contract",
    "KVCache": "foretell.model.kvcache",
    "RotatingKVCache": "foretell.model.kvcache",
    "SlidingKVCache": "foretell.model.kvcache",
    "add_rollback_reserve": "foretell.model.kvcache",
    "can_trim": "foretell.model.kvcache",
    "stay_trimmable": "foretell.model.kvcache",
    "trim_all": "foretell.model.kvcache",
    "BatchKVCache": "foretell.model.batch",
    "batch_caches": "foretell.model.batch",
    "Mask": "foretell.model.attention",
    "attend": "foretell.model.attention",
    "attention_mask": "foretell.model.attention",
    "causal_mask": "foretell.model.attention",
    "FixedForward": "foretell.model.fixed",
    "fits_fixed_shapes": "foretell.model.fixed",
    "fixed_for": "foretell.model.fixed",
    "fixed_or_ordinary": "foretell.model.fixed",
    "fixed_shapes_on": "foretell.model.fixed",
    "RoPE": "foretell.model.rope",
    "make_rope": "foretell.model.rope",
    "args_from_config": "foretell.model.loading",
    "load_model": "foretell.model.loading",
    "quantize_like_checkpoint": "foretell.model.loading",
    "read_config": "foretell.model.loading",
    "require_divides": "foretell.model.loading",
    "should_unpack_quantized": "foretell.model.loading",
    "fit_to_device": "foretell.model.loading",
    "unpack_quantized": "foretell.model.loading",
}

__getattr__, __all__ = lazy_exports(__name__, _WHERE)
