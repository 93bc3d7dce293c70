"""Core's own contributions: baseline KV-cache codecs and the single-file storage layout.

Registered as a core-internal plugin before any entry point, the way pytest registers its
``_pytest`` modules; they go through the same hooks a third party uses.
"""

from foretell.plugin.hookspecs import hookimpl


@hookimpl
def foretell_register_cache_codecs(register):
    register(
        "kv",
        "foretell.cache.codecs:StandardKVCodec",
        summary="growable, trimmable KV cache (full attention layers)",
    )
    register(
        "rotating-kv",
        "foretell.cache.codecs:RotatingKVCodec",
        summary="sliding-window ring cache; trimmable only before it wraps",
    )
    register(
        "sliding-kv",
        "foretell.cache.codecs:SlidingKVCodec",
        summary="sliding window plus a rollback reserve, in time order (speculative targets)",
    )
    register(
        "quantized-kv",
        "foretell.cache.quantized:QuantizedKVCodec",
        summary="affine-quantized KV cache (4/8-bit, groups along head_dim; --kv-bits)",
    )
    register(
        "generation",
        "foretell.cache.checkpoint:GenerationCodec",
        summary="where an in-flight generation stood (crash-resumable checkpoints)",
    )
    register(
        "draft-state",
        "foretell.cache.attachment:DraftAttachmentCodec",
        summary="a drafter's state stored with the target's entry (exact boundary only)",
    )


@hookimpl
def foretell_register_storage_layouts(register):
    from foretell.store.single_file import SingleFileConfig

    register(
        "single-file",
        "foretell.store.single_file:SingleFileLayout",
        config=SingleFileConfig,
        summary="one safetensors file per cache entry, written atomically",
    )
